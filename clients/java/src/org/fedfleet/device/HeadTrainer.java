// Local SGD on a linear softmax head, the Python device's step (edge_client/tasks/numpy_head.py):
// logits = f W^T + b, mean cross-entropy on logits / T over the mini-batch, then
// param -= lr * (d + weight_decay * param) (torch.optim.SGD with weight decay; d the gradient or
// what the task's local rule makes of it: FedSAM, FedASAM, FedProx, as local_rules.py), batches in
// LocalTraining's seeded order. The head is held in float32 between steps, as on the Python
// device; each step's gradient is computed in double and rounded once into the float32 update.
package org.fedfleet.device;

import java.util.Iterator;

public final class HeadTrainer {
    /** A trained head: weight (C·d, row-major), bias (C), the rows it was trained on, the steps
     *  taken and the mean mini-batch loss of the last epoch (each taken before its step). */
    public static final class Trained {
        public final float[] weight, bias;
        public final int n, steps;
        public final double meanLoss;
        Trained(float[] weight, float[] bias, int n, int steps, double meanLoss) {
            this.weight = weight; this.bias = bias; this.n = n; this.steps = steps; this.meanLoss = meanLoss;
        }
    }

    private final int numClasses, dim;
    private final float lr, weightDecay, temperature;     // float32, as numpy_head holds them
    private final String rule;                             // edge_client/tasks/local_rules.py's rules
    private final double rho, eta, mu;
    private float[] startW, startB;                        // the round's global head (FedProx's anchor)
    private float[] anchorW, anchorB;                      // another anchor (Ditto's personal pass: the task's head)
    private float[] correctionW, correctionB;              // subtracted after each step (Scaffold's lr·(c − c_k))
    private boolean trainWeight = true, trainBias = true;  // FedAlt moves one of them, holding the other

    /** FedProx's pull towards (weight, bias) instead of the start (Ditto's personal pass). */
    public HeadTrainer pulledTo(float[] weight, float[] bias) {
        anchorW = weight.clone(); anchorB = bias.clone();
        return this;
    }

    /** After each step, param -= correction in float32 (Scaffold: lr·(c − c_k), scaffold_training.py). */
    public HeadTrainer corrected(float[] weight, float[] bias) {
        correctionW = weight.clone(); correctionB = bias.clone();
        return this;
    }

    /** Which tensors the steps move (the other held fixed: FedAlt's phases, partial_training.py). */
    public HeadTrainer moving(boolean weight, boolean bias) {
        trainWeight = weight; trainBias = bias;
        return this;
    }

    public HeadTrainer(int numClasses, int dim, LocalTraining recipe) {
        this.numClasses = numClasses; this.dim = dim;
        this.lr = (float) recipe.lr; this.weightDecay = (float) recipe.weightDecay; this.temperature = (float) recipe.temperature;
        this.rule = recipe.localRule; this.rho = recipe.samRho; this.eta = recipe.asamEta; this.mu = recipe.proxMu;
    }

    /** recipe.epochs epochs from (weight, bias) over features (n × dim) with labels in [0, C).
     *  IllegalArgumentException for bad shapes or labels, ArithmeticException when training diverges. */
    public Trained train(float[] weight, float[] bias, float[][] features, int[] labels, LocalTraining recipe) {
        if (weight.length != numClasses * dim || bias.length != numClasses)
            throw new IllegalArgumentException("head must be (" + numClasses + ", " + dim + ") and (" + numClasses + ")");
        if (features.length == 0 || labels.length != features.length)
            throw new IllegalArgumentException("need one label per feature row and at least one row");
        for (int k = 0; k < labels.length; k++) {
            if (features[k].length != dim) throw new IllegalArgumentException("feature row " + k + " has " + features[k].length + " values, not " + dim);
            if (labels[k] < 0 || labels[k] >= numClasses)
                throw new IllegalArgumentException("label " + labels[k] + " outside [0, " + numClasses + ")");
        }
        float[] w = weight.clone(), b = bias.clone();
        startW = anchorW != null ? anchorW : weight.clone();
        startB = anchorB != null ? anchorB : bias.clone();
        LocalTraining.Schedule batches = recipe.batchSchedule(labels.length);
        recipe.work(labels.length, (long) numClasses * (dim + 1));      // steps, then work: as the Python device
        int lastEpoch = Math.max(1, batches.size() / Math.max(1, recipe.epochs));     // 0 epochs: no steps
        double lossSum = 0;
        Iterator<int[]> steps = batches.iterator();
        for (int s = 0; s < batches.size(); s++) {
            double loss = step(w, b, features, labels, steps.next());
            if (correctionW != null) {
                for (int k = 0; k < w.length; k++) w[k] -= correctionW[k];
                for (int k = 0; k < b.length; k++) b[k] -= correctionB[k];
            }
            if (s >= batches.size() - lastEpoch) lossSum += loss;
        }
        checkBounded("weight", w);
        checkBounded("bias", b);
        return new Trained(w, b, labels.length, batches.size(), lossSum / lastEpoch);
    }

    /** The protocol's bound on a trained parameter (protocols/payloads/fedavg.py MAX_ABS_TRAINED):
     *  finite and |x| ≤ 2^20. Training that ends outside it is declined as diverged, as on the
     *  Python device: this device's double-precision logits would not overflow where the Python
     *  device's float32 ones do, so "not NaN" alone let it upload a ±5e18 head the others decline. */
    public static final double MAX_ABS_TRAINED = 1 << 20;

    static void checkBounded(String name, float[] values) {
        for (float v : values) {
            if (!Float.isFinite(v))
                throw new ArithmeticException("local training diverged (tensor '" + name + "' contains NaN or Inf); lower the learning rate");
            if (Math.abs(v) > MAX_ABS_TRAINED)
                throw new ArithmeticException("local training diverged (tensor '" + name + "' holds |x| = " + Math.abs(v)
                        + " > 1.04858e+06 (2^20)); lower the learning rate");
        }
    }


    /** One step on the rows `batch`, in place; returns the batch's mean loss before the step. Its
     *  direction: the gradient (sgd), or the gradient at w + ε̂, ε̂ = ρ T² g/‖T g‖ (T = 1: sam;
     *  T = |w| + η: asam), plus μ(w − w_global) under FedProx; then w -= lr (d + wd w). */
    double step(float[] w, float[] b, float[][] features, int[] labels, int[] batch) {
        double[] gradW = new double[w.length], gradB = new double[b.length];
        double loss = gradient(w, b, features, labels, batch, gradW, gradB);
        if (!rule.equals("sgd")) {
            boolean adaptive = rule.equals("asam");
            double norm = 0;
            for (int k = 0; k < w.length; k++) norm += sq((adaptive ? Math.abs(w[k]) + eta : 1) * gradW[k]);
            for (int k = 0; k < b.length; k++) norm += sq((adaptive ? Math.abs(b[k]) + eta : 1) * gradB[k]);
            double scale = rho / (Math.sqrt(norm) + 1e-12);
            float[] pw = perturbed(w, gradW, scale, adaptive), pb = perturbed(b, gradB, scale, adaptive);
            gradW = new double[w.length]; gradB = new double[b.length];
            gradient(pw, pb, features, labels, batch, gradW, gradB);
        }
        if (mu > 0) loss += proximal(w, startW, gradW) + proximal(b, startB, gradB);
        if (trainWeight) update(w, gradW);
        if (trainBias) update(b, gradB);
        return loss;
    }

    private static double sq(double x) { return x * x; }

    private float[] perturbed(float[] param, double[] grad, double scale, boolean adaptive) {
        float[] out = new float[param.length];
        for (int k = 0; k < param.length; k++) {
            double t = adaptive ? Math.abs(param[k]) + eta : 1;
            out[k] = param[k] + (float) (scale * t * t * grad[k]);
        }
        return out;
    }

    /** Adds μ(w − w_global) to grad; returns μ/2‖w − w_global‖² (the objective's proximal term). */
    private double proximal(float[] param, float[] start, double[] grad) {
        double term = 0;
        for (int k = 0; k < param.length; k++) {
            double pull = (double) param[k] - start[k];
            grad[k] += mu * pull;
            term += 0.5 * mu * pull * pull;
        }
        return term;
    }

    /** The batch's mean loss at (w, b), its gradient accumulated into gradW, gradB (double). */
    private double gradient(float[] w, float[] b, float[][] features, int[] labels, int[] batch, double[] gradW, double[] gradB) {
        double[] scaled = new double[numClasses];
        double share = 1.0 / batch.length, loss = 0;
        for (int row : batch) {
            float[] f = features[row];
            double max = Double.NEGATIVE_INFINITY;
            for (int c = 0; c < numClasses; c++) {
                double z = b[c];
                for (int j = 0; j < dim; j++) z += (double) f[j] * w[c * dim + j];
                scaled[c] = z / temperature;
                max = Math.max(max, scaled[c]);
            }
            double norm = 0;
            for (int c = 0; c < numClasses; c++) norm += Math.exp(scaled[c] - max);
            double logNorm = max + Math.log(norm);
            loss -= share * (scaled[labels[row]] - logNorm);
            for (int c = 0; c < numClasses; c++) {      // d mean-loss / d logits: (softmax - onehot) / (B·T)
                double g = (Math.exp(scaled[c] - logNorm) - (c == labels[row] ? 1 : 0)) * share / temperature;
                gradB[c] += g;
                for (int j = 0; j < dim; j++) gradW[c * dim + j] += g * f[j];
            }
        }
        return loss;
    }

    private void update(float[] param, double[] grad) {
        for (int k = 0; k < param.length; k++) param[k] = (float) (param[k] - lr * (grad[k] + weightDecay * param[k]));
    }
}
