// The local SGD recipe of a task's params (edge_client/tasks/head_training.py LocalTraining):
// epochs, batch_size, lr, weight_decay, temperature, seed, and the local step rule
// (protocols/payloads/fedavg.py LocalRuleRecipe: local_rule sgd | sam | asam, sam_rho, asam_eta,
// prox_mu), with the Python device's defaults and checks, and its mini-batch schedule: per epoch a seeded numpy permutation of the rows, cut into
// batches of batch_size (the last one may be smaller).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Arrays;
import java.util.Iterator;
import java.util.Map;
import java.util.NoSuchElementException;

public final class LocalTraining {
    public final int epochs, batchSize;
    public final double lr, weightDecay, temperature;
    public final BigInteger seed;
    public final String localRule;                       // "sgd", "sam" (FedSAM) or "asam" (FedASAM)
    public final double samRho, asamEta, proxMu;         // ρ, ASAM's η, FedProx's μ (0: off)

    public LocalTraining(int epochs, int batchSize, double lr, double weightDecay, double temperature, BigInteger seed) {
        this(epochs, batchSize, lr, weightDecay, temperature, seed, "sgd", 0.1, 0.2, 0.0);
    }

    public LocalTraining(int epochs, int batchSize, double lr, double weightDecay, double temperature, BigInteger seed,
                         String localRule, double samRho, double asamEta, double proxMu) {
        this.epochs = epochs; this.batchSize = batchSize; this.lr = lr; this.weightDecay = weightDecay;
        this.temperature = temperature; this.seed = seed;
        this.localRule = localRule; this.samRho = samRho; this.asamEta = asamEta; this.proxMu = proxMu;
    }

    /** The recipe a task's params name; missing fields take the Fed3R paper's FL defaults ([P] §IV). */
    public static LocalTraining fromParams(Map<String, Object> params) throws TaskDeclined {
        return new LocalTraining(
                (int) Params.integer(params, "epochs", 1, 1, 10_000),     // protocols.payloads.fedavg.MAX_EPOCHS
                (int) Params.integer(params, "batch_size", 50, 1, 1 << 30),
                Params.number(params, "lr", 0.1, false), Params.number(params, "weight_decay", 4e-5, true),
                Params.number(params, "temperature", 0.1, false), seed(params), rule(params),
                bounded(params, "sam_rho", 0.1, 100), bounded(params, "asam_eta", 0.2, 100), bounded(params, "prox_mu", 0.0, 1e4));
    }

    /** local_rule (sgd | sam | asam; sam and asam need sam_rho > 0): LocalRuleRecipe's check. */
    static String rule(Map<String, Object> params) throws TaskDeclined {
        String rule = params.containsKey("local_rule") ? Params.string(params, "local_rule") : "sgd";
        if (!rule.equals("sgd") && !rule.equals("sam") && !rule.equals("asam"))
            throw new TaskDeclined("bad task params: local_rule must be one of sgd, sam, asam, got " + rule);
        if (!rule.equals("sgd") && Params.number(params, "sam_rho", 0.1, true) <= 0)
            throw new TaskDeclined("bad task params: " + rule + " needs sam_rho > 0");
        return rule;
    }

    static double bounded(Map<String, Object> params, String key, double dflt, double max) throws TaskDeclined {
        double x = Params.number(params, key, dflt, true);
        if (x > max) throw new TaskDeclined("bad task params: " + key + " must be a finite number in [0, " + max + "], got " + x);
        return x;
    }

    /** This recipe's task params (protocols/payloads/fedavg.py LocalTraining.to_params). */
    void toParams(Map<String, Object> out) {
        out.put("epochs", BigInteger.valueOf(epochs));
        out.put("batch_size", BigInteger.valueOf(batchSize));
        out.put("lr", lr);
        out.put("weight_decay", weightDecay);
        out.put("temperature", temperature);
        out.put("seed", seed);
        out.put("local_rule", localRule);
        out.put("sam_rho", samRho);
        out.put("asam_eta", asamEta);
        out.put("prox_mu", proxMu);
    }

    /** The most SGD steps one task may ask of a device (protocols/payloads/fedavg.py MAX_LOCAL_STEPS). */
    public static final long MAX_LOCAL_STEPS = 1_000_000L;
    /** The most multiply-adds one task's head training may ask (protocols/payloads/fedavg.py MAX_LOCAL_WORK):
     *  epochs x rows x the heads' parameters a row meets x the gradient evaluations of a step. */
    public static final double MAX_LOCAL_WORK = 1e13;

    /** The gradient evaluations each step of this recipe takes (local_rules.py evaluations_per_step):
     *  FedSAM/FedASAM's 2, at w and at w + ε̂ (HeadTrainer.step), plain SGD's and FedProx's 1. */
    public int gradientEvaluations() { return localRule.equals("sgd") ? 1 : 2; }

    /** The multiply-adds of this recipe over `rows` rows through `perRow` head parameters, epochs x rows x
     *  perRow x gradientEvaluations() (check_local_work; counted in double: no overflow);
     *  IllegalArgumentException past MAX_LOCAL_WORK. SAM's step was counted once, so a SAM task asked
     *  up to twice the budget. */
    public double work(int rows, long perRow) {
        int evaluations = gradientEvaluations();
        double work = (double) epochs * rows * perRow * evaluations;
        if (work > MAX_LOCAL_WORK)
            throw new IllegalArgumentException("local training of " + epochs + " epochs over " + rows + " samples through "
                + perRow + " head parameters"
                + (evaluations != 1 ? ", " + evaluations + " gradient evaluations a step," : "")
                + " is " + multiplyAdds(work) + ", more than a device takes (1e+13)");
        return work;
    }

    private static String multiplyAdds(double work) {
        return String.format(java.util.Locale.ROOT, "%.2e", work) + " multiply-adds";
    }

    /** The SGD steps of this recipe over `rows` rows, epochs x ceil(rows / batch_size) (check_local_steps);
     *  IllegalArgumentException past MAX_LOCAL_STEPS. */
    public long steps(int rows) {
        long steps = batchSize > 0 ? (long) epochs * ((rows + (long) batchSize - 1) / batchSize) : 0;
        if (steps > MAX_LOCAL_STEPS)
            throw new IllegalArgumentException("local training of " + epochs + " epochs over " + rows + " samples in "
                + "batches of " + batchSize + " is " + steps + " SGD steps, more than a device takes (" + MAX_LOCAL_STEPS + ")");
        return steps;
    }

    /** One training pass of a task: this recipe over `rows` rows (checkPasses). */
    public static final class Pass {
        final LocalTraining recipe;
        final int rows;
        Pass(LocalTraining recipe, int rows) { this.recipe = recipe; this.rows = rows; }
    }

    public Pass over(int rows) { return new Pass(this, rows); }

    /** A task's training passes, through `perRow` head parameters each, counted as one task
     *  (numpy_head.py within_passes_budget): their steps summed (a pass past the budget alone has
     *  steps(rows)'s message), IllegalArgumentException "`what` is S SGD steps, ..." past
     *  MAX_LOCAL_STEPS; then their multiply-adds summed (a pass past it alone: work's message),
     *  "`what` is W multiply-adds, ..." past MAX_LOCAL_WORK. Each pass was checked alone as it started,
     *  so a task of several passes asked several budgets (Ditto's and FedAlt's two, FP(psi)'s folds x
     *  rates fits and its chosen rate's). */
    public static void checkPasses(String what, long perRow, Pass... passes) {
        long steps = 0;
        for (Pass p : passes) steps += p.recipe.steps(p.rows);
        if (steps > MAX_LOCAL_STEPS)
            throw new IllegalArgumentException(what + " is " + steps + " SGD steps, more than a device takes ("
                + MAX_LOCAL_STEPS + ")");
        double work = 0;
        for (Pass p : passes) work += p.recipe.work(p.rows, perRow);
        if (work > MAX_LOCAL_WORK)
            throw new IllegalArgumentException(what + " is " + multiplyAdds(work)
                + ", more than a device takes (1e+13)");
    }

    /** The row positions of each SGD step (protocols/payloads/fedavg.py batch_schedule);
     *  IllegalArgumentException past MAX_LOCAL_STEPS steps. The schedule's steps are drawn as they
     *  are taken: one epoch's permutation is held at a time (a list of every step held epochs x
     *  rows positions, within the step budget too). */
    public Schedule batchSchedule(int rows) {
        return new Schedule(rows, (int) steps(rows));
    }

    /** A batch schedule: size() steps, each a batch's row positions, in order. Taking a step
     *  checks the running task's moment first (WorkDeadline: PastDeadline once its round is over),
     *  so every local-training loop stops with its round. */
    public final class Schedule implements Iterable<int[]> {
        private final int rows, steps;

        Schedule(int rows, int steps) { this.rows = rows; this.steps = steps; }

        public int size() { return steps; }

        @Override
        public Iterator<int[]> iterator() {
            return new Iterator<int[]>() {
                private final NumpyGenerator rng = NumpyGenerator.fromSeed(seed);
                private int[] order;
                private int start = rows, taken;      // start past the rows: the next step draws an epoch

                @Override public boolean hasNext() { return taken < steps; }

                @Override public int[] next() {
                    if (!hasNext()) throw new NoSuchElementException();
                    WorkDeadline.stopIfPast();
                    if (start >= rows) {
                        order = rng.permutation(rows);
                        start = 0;
                    }
                    int[] batch = Arrays.copyOfRange(order, start, Math.min(rows, start + batchSize));
                    start += batchSize;
                    taken++;
                    return batch;
                }
            };
        }
    }

    private static BigInteger seed(Map<String, Object> params) throws TaskDeclined {
        Object v = params.getOrDefault("seed", BigInteger.ZERO);
        if (!(v instanceof BigInteger) || ((BigInteger) v).signum() < 0)
            throw new TaskDeclined("bad task params: seed must be an integer >= 0, got " + v);
        return (BigInteger) v;
    }
}
