// The frozen backbone: model inputs in, feature vectors out. On Android it is ExecuTorch's Java
// Module running the bundle's .pte (docs/deployment.md "Android"); in the tests the inputs already
// are the features the exported program produced (PrecomputedFeatures).
package org.fedfleet.device;

public interface FeatureExtractor {
    /** Declines a task whose model (backbone, image_size, weights_sha256, bundle_sha256) is not this extractor's. */
    void checkModel(ModelSpec model) throws TaskDeclined;

    int featureDim();

    /** Features of a batch of inputs, one row per input, featureDim() values each. */
    float[][] extract(float[][] inputs) throws TaskDeclined;
}
