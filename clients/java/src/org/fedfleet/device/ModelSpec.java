// The model a classification task runs (protocols/payloads/task_params.py ModelSpec): the
// backbone, its input size and weights, the exported bundle (sha256 of its manifest; "" lets the
// device use its own), the classes. Public: a FeatureExtractor checks a task's model against its
// own (checkModel) from these fields, never from the raw params.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Map;

public final class ModelSpec {
    public final int numClasses, imageSize;
    public final String backbone, weightsSha256, bundleSha256;

    private ModelSpec(int numClasses, String backbone, int imageSize, String weightsSha256, String bundleSha256) {
        this.numClasses = numClasses; this.backbone = backbone; this.imageSize = imageSize;
        this.weightsSha256 = weightsSha256; this.bundleSha256 = bundleSha256;
    }

    static ModelSpec fromParams(Map<String, Object> params) throws TaskDeclined {
        return new ModelSpec((int) Params.integer(params, "num_classes", 1, 1_000_000), Params.string(params, "backbone", 128),
                (int) Params.integer(params, "image_size", 1, 16_384), sha(params, "weights_sha256"), sha(params, "bundle_sha256"));
    }

    private static String sha(Map<String, Object> params, String key) throws TaskDeclined {
        String v = params.containsKey(key) ? Params.string(params, key) : "";
        if (!v.isEmpty() && !v.matches("[0-9a-f]{64}"))
            throw new TaskDeclined("bad task params: " + key + " must be empty or 64 lowercase hex digits, got " + v);
        return v;
    }

    void toParams(Map<String, Object> out) {
        out.put("num_classes", BigInteger.valueOf(numClasses));
        out.put("backbone", backbone);
        out.put("image_size", BigInteger.valueOf(imageSize));
        out.put("weights_sha256", weightsSha256);
        out.put("bundle_sha256", bundleSha256);
    }
}
