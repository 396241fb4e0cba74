// FP(ψ)'s learning rate picked by k-fold cross-validation on the device's own training split
// (edge_client/oll.py choose_fp_lr): the rows in a seeded numpy permutation, cut as
// np.array_split cuts them; for each candidate rate the OLL head is fine-tuned on all parts but
// one and scored on the one left out, in turn; the most correct answers win, ties to the earlier
// candidate. With one candidate, or fewer rows than folds, the first candidate, untrained.
package org.fedfleet.device;

import java.util.Arrays;

public final class FpLearningRate {
    public final double chosen;
    /** Cross-validated accuracy per candidate (empty when nothing was trained). */
    public final double[] scores;

    private FpLearningRate(double chosen, double[] scores) { this.chosen = chosen; this.scores = scores; }

    /** ArithmeticException when a fine-tuning diverges. */
    public static FpLearningRate choose(OllHead head, float[][] features, int[] labels, LocalTraining recipe,
                                        double[] candidates, int folds) {
        if (candidates.length == 0) throw new IllegalArgumentException("no candidate learning rates");
        for (double lr : candidates)
            if (!Double.isFinite(lr) || lr <= 0) throw new IllegalArgumentException("candidate learning rates must be finite and > 0, got " + Arrays.toString(candidates));
        if (folds < 2) throw new IllegalArgumentException("folds must be an integer >= 2, got " + folds);
        int n = labels.length;
        if (candidates.length == 1 || n < folds) return new FpLearningRate(candidates[0], new double[0]);
        int[] starts = new int[folds + 1];                 // np.array_split: the first n % folds parts one longer
        for (int p = 0; p < folds; p++) starts[p + 1] = starts[p] + n / folds + (p < n % folds ? 1 : 0);
        // every head counts (folds x candidates, each fit on the other folds' rows), its steps and
        // multiply-adds with the chosen rate's fit on all rows after (PersonalizeTask's): as the Python
        // device's within_cross_validation_budget, before any is trained
        LocalTraining.Pass[] fits = new LocalTraining.Pass[folds * candidates.length + 1];
        for (int i = 0; i < folds * candidates.length; i++) {
            int p = i % folds;
            fits[i] = recipe.over(n - (starts[p + 1] - starts[p]));
        }
        fits[fits.length - 1] = recipe.over(n);
        LocalTraining.checkPasses("cross-validation of " + candidates.length + " learning rates over " + folds
                + " folds, then the chosen rate's fit on all " + n + " samples, " + recipe.epochs
                + " epochs each in batches of " + recipe.batchSize + ",", (long) head.k() * (head.dim + 1), fits);
        int[] order = NumpyGenerator.fromSeed(recipe.seed).permutation(n);
        int[] local = new int[n];
        for (int i = 0; i < n; i++) local[i] = head.toLocal(labels[i]);
        double[] scores = new double[candidates.length];
        for (int c = 0; c < candidates.length; c++) {
            LocalTraining withLr = new LocalTraining(recipe.epochs, recipe.batchSize, candidates[c], recipe.weightDecay,
                    recipe.temperature, recipe.seed);
            HeadTrainer trainer = new HeadTrainer(head.k(), head.dim, withLr);
            int correct = 0;
            for (int p = 0; p < folds; p++) {
                int fitRows = n - (starts[p + 1] - starts[p]);
                float[][] fitFeatures = new float[fitRows][];
                int[] fitLabels = new int[fitRows];
                int r = 0;
                for (int q = 0; q < folds; q++) {
                    if (q == p) continue;
                    for (int i = starts[q]; i < starts[q + 1]; i++) { fitFeatures[r] = features[order[i]]; fitLabels[r++] = local[order[i]]; }
                }
                HeadTrainer.Trained t = trainer.train(head.weight, head.bias, fitFeatures, fitLabels, withLr);
                for (int i = starts[p]; i < starts[p + 1]; i++)
                    if (head.globalIds[OllHead.argmax(t.weight, t.bias, head.dim, features[order[i]])] == labels[order[i]]) correct++;
            }
            scores[c] = (double) correct / n;
        }
        int best = 0;
        for (int c = 1; c < candidates.length; c++) if (scores[c] > scores[best]) best = c;
        return new FpLearningRate(candidates[best], scores);
    }
}
