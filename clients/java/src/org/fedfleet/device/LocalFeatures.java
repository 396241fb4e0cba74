// The local samples through the feature extractor, in batches (an app's backbone runs on a
// few images at a time): what the head-level training tasks start from.
package org.fedfleet.device;

final class LocalFeatures {
    static final int BATCH = 64;

    private LocalFeatures() {}

    static float[][] extract(LocalData data, FeatureExtractor extractor) throws TaskDeclined {
        float[][] out = new float[data.size()][];
        for (int start = 0; start < data.size(); start += BATCH) {
            int end = Math.min(start + BATCH, data.size());
            float[][] inputs = new float[end - start][];
            for (int i = start; i < end; i++) inputs[i - start] = data.input(i);
            float[][] feats = extractor.extract(inputs);
            if (feats.length != inputs.length) throw new TaskDeclined("feature extractor returned " + feats.length + " rows for " + inputs.length + " inputs");
            System.arraycopy(feats, 0, out, start, feats.length);
        }
        return out;
    }

    static int[] labels(LocalData data, int numClasses) throws TaskDeclined {
        int[] out = new int[data.size()];
        for (int i = 0; i < out.length; i++) {
            out[i] = data.label(i);
            if (out[i] < 0 || out[i] >= numClasses)
                throw new TaskDeclined("local label " + out[i] + " outside the job's " + numClasses + " classes");
        }
        return out;
    }
}
