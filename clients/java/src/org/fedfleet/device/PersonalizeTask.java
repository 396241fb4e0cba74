// Task kind "oll.personalize" (protocols/payloads/personalize.py): on the device's held-out split,
// the correct answers of the global head, of OLL (the head pruned to the local training labels)
// and, when the task asks for fp_epochs > 0, of OLL+FP(ψ) (the pruned head fine-tuned on the
// training split at the rate FpLearningRate picks). Only counts go back; the personalised head
// stays on the device (`head`, for the app's predictions). Tasks whose global model carries a
// fine-tuned backbone tail (tail_stages > 0) are declined: this library runs no tail.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public final class PersonalizeTask implements TaskHandler {
    public static final String KIND = "oll.personalize";
    private final LocalData train, heldOut;
    private final FeatureExtractor extractor;
    /** The last personalised head (OLL, after FP(ψ) when the task asked for it). */
    public volatile OllHead head;
    /** The last cross-validation (null without FP(ψ)). */
    public volatile FpLearningRate lastChoice;

    public PersonalizeTask(LocalData train, LocalData heldOut, FeatureExtractor extractor) {
        this.train = train; this.heldOut = heldOut; this.extractor = extractor;
    }

    @Override
    public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        if (train.size() == 0 || heldOut.size() == 0) throw new TaskDeclined("personalization needs local training and held-out data");
        PersonalizeParams task = PersonalizeParams.fromParams(params);
        if (task.fpEpochs > 0 && !task.fpPart.equals("psi"))        // FP(φ)/FP(M) train the backbone's tail: no tail program here
            throw new TaskDeclined("FP(" + task.fpPart + ") fine-tunes the backbone's tail; this device fine-tunes the head only (FP(ψ))");
        int numClasses = task.model.numClasses, dim = task.featureDim;
        if (task.tailStages > 0)
            throw new TaskDeclined("this device has no tail bundle: it cannot personalise a fine-tuned backbone");
        String fallback = task.fallback;
        int fpEpochs = task.fpEpochs, folds = task.fpFolds;
        double[] lrs = task.fpLrs;
        LocalTraining recipe = task.recipe;
        for (Envelope.Tensor t : tensors)
            if (t.name.startsWith("tail.")) throw new TaskDeclined("task carries backbone tail tensors but says tail_stages = 0");
        float[] weight = FedAvgHeadTask.headTensor(KIND, tensors, "weight", new long[] {numClasses, dim});
        float[] bias = FedAvgHeadTask.headTensor(KIND, tensors, "bias", new long[] {numClasses});
        int[] yTrain = LocalFeatures.labels(train, numClasses), yTest = LocalFeatures.labels(heldOut, numClasses);
        extractor.checkModel(task.model);
        if (extractor.featureDim() != dim)
            throw new TaskDeclined("backbone gives " + extractor.featureDim() + "-d features, task expects " + dim);
        float[][] fTrain = LocalFeatures.extract(train, extractor), fTest = LocalFeatures.extract(heldOut, extractor);

        Map<String, Object> correct = new LinkedHashMap<>();
        int global = 0;
        for (int i = 0; i < yTest.length; i++) if (OllHead.argmax(weight, bias, dim, fTest[i]) == yTest[i]) global++;
        correct.put("global", BigInteger.valueOf(global));
        OllHead oll = new OllHead(weight, bias, dim, yTrain, fallback.equals("global"));
        OllHead.Scored scored;
        try {
            scored = oll.score(fTest, yTest);
        } catch (IllegalArgumentException e) {
            throw new TaskDeclined("OLL with fallback='error': " + e.getMessage());
        }
        correct.put("oll", BigInteger.valueOf(scored.correct));
        Object fpLr = Json.NULL;
        FpLearningRate choice = null;
        if (fpEpochs > 0) {
            try {
                choice = FpLearningRate.choose(oll, fTrain, yTrain, recipe, lrs, folds);
                LocalTraining tuned = new LocalTraining(recipe.epochs, recipe.batchSize, choice.chosen, recipe.weightDecay,
                        recipe.temperature, recipe.seed);
                int[] local = new int[yTrain.length];
                for (int i = 0; i < local.length; i++) local[i] = oll.toLocal(yTrain[i]);
                HeadTrainer.Trained t = new HeadTrainer(oll.k(), dim, tuned).train(oll.weight, oll.bias, fTrain, local, tuned);
                oll.weight = t.weight;
                oll.bias = t.bias;
            } catch (ArithmeticException | IllegalArgumentException e) {
                throw new TaskDeclined(e.getMessage());
            }
            correct.put("oll_fp", BigInteger.valueOf(oll.score(fTest, yTest).correct));
            fpLr = choice.chosen;
        }
        head = oll;
        lastChoice = choice;
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("n_train", BigInteger.valueOf(yTrain.length));
        body.put("n_test", BigInteger.valueOf(yTest.length));
        body.put("local_classes", BigInteger.valueOf(oll.k()));
        body.put("correct", correct);
        body.put("fallback", BigInteger.valueOf(scored.fallback));
        body.put("fp_lr", fpLr);
        return new Result(body, new ArrayList<Envelope.Tensor>());
    }
}
