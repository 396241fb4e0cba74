// A FeatureExtractor whose inputs are already features (computed offline by the bundle's exported
// program): for tests and for apps that run the backbone elsewhere. It accepts any model fields
// of a task but checks that the inputs have the dimension it was built for.
package org.fedfleet.device;

public final class PrecomputedFeatures implements FeatureExtractor {
    private final int dim;

    public PrecomputedFeatures(int dim) { this.dim = dim; }

    @Override public void checkModel(ModelSpec model) {}

    @Override public int featureDim() { return dim; }

    @Override public float[][] extract(float[][] inputs) throws TaskDeclined {
        for (float[] x : inputs)
            if (x.length != dim) throw new TaskDeclined("input has " + x.length + " values, the features " + dim);
        return inputs;
    }
}
