// ladd.train params (protocols/payloads/ladd.py LaddTrainParams): the segmentation model's spec (a
// JSON object), the device's cluster (0..1000), the exchanged state's layout ([name, shape] pairs,
// names distinct, at most 5e7 values) and its sha256 (of Python's compact ASCII JSON of the
// layout), the trainable tensors (1..100000 names), the teacher (model | tensor), the weights' and
// the KD tensor's sha256 (empty or 64 hex), and the self-training recipe (SelfTrainingRecipe with
// the FedAvg family's local rule, flat). This library does not serve ladd.train (no segmentation
// model); it reads the params exactly as the Python device does (golden params).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.regex.Pattern;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public class LaddTrainParams {
    static final String KIND = "ladd.train";
    static final long MAX_PARAMETERS = 50_000_000L;
    private static final Pattern SHA = Pattern.compile("[0-9a-f]{64}");
    // the recipe's numbers: name, default, low, high, low allowed
    private static final Object[][] NUMBERS = {{"lr", 0.01, 0.0, 10.0, false}, {"momentum", 0.9, 0.0, 1.0, true},
            {"kd_lambda", 10.0, 0.0, 1e4, true}, {"kd_alpha", 0.5, 0.0, 100.0, false},
            {"pseudo_quantile", 0.66, 0.0, 1.0, true}, {"pseudo_cap", 0.9, 0.0, 1.0, false}};
    private final Map<String, Object> wire = new LinkedHashMap<>();      // every field, as the task wrote it or defaulted

    LaddTrainParams(Map<String, Object> p, String kind) throws TaskDeclined {
        TaskParams.checkVersion(p, kind);
        TaskParams.require(p, kind, "model", "cluster", "layout", "layout_sha256", "trainable");
        recipe(p, kind);
        Object model = p.get("model");
        if (!(model instanceof Map)) throw bad(kind, "model must be a JSON object (the segmentation spec), got " + model);
        wire.put("model", model);
        wire.put("cluster", BigInteger.valueOf(Params.integer(p, "cluster", 0, 1_000)));
        List<Object> layout = layout(p.get("layout"), kind, "layout");
        wire.put("layout", layout);
        if (!digest(layout).equals(p.get("layout_sha256"))) throw bad(kind, "layout_sha256 does not match the layout");
        wire.put("layout_sha256", p.get("layout_sha256"));
        Object trainable = p.get("trainable");
        if (!(trainable instanceof List) || ((List<?>) trainable).isEmpty() || ((List<?>) trainable).size() > 100_000)
            throw bad(kind, "trainable must name 1 to 100000 tensors");
        for (Object name : (List<?>) trainable)
            if (!(name instanceof String) || Json.characters((String) name) > 256) throw bad(kind, "trainable[i] must be a string, got " + name);
        wire.put("trainable", trainable);
        wire.put("teacher", TaskParams.choice(p, "teacher", "model", "model", "tensor"));
        for (String key : new String[] {"weights_sha256", "kd_sha256"}) {
            Object v = p.getOrDefault(key, "");
            if (!(v instanceof String) || (!((String) v).isEmpty() && !SHA.matcher((String) v).matches()))
                throw bad(kind, key + " must be empty or 64 lowercase hex digits, got " + v);
            wire.put(key, v);
        }
    }

    public static LaddTrainParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new LaddTrainParams(params, KIND);
    }

    static TaskDeclined bad(String kind, String why) {
        return new TaskDeclined("bad " + kind + " params: " + why);
    }

    /** SelfTrainingRecipe's fields (and its local rule), checked and kept as written. */
    private void recipe(Map<String, Object> p, String kind) throws TaskDeclined {
        for (String key : new String[] {"epochs", "batch_size"}) {
            Object v = p.getOrDefault(key, BigInteger.valueOf(key.equals("epochs") ? 1 : 8));
            if (!(v instanceof BigInteger) || ((BigInteger) v).signum() < 1 || ((BigInteger) v).compareTo(BigInteger.valueOf(10_000)) > 0)
                throw bad(kind, key + " must be an integer in [1, 10000], got " + v);
            wire.put(key, v);
        }
        for (Object[] n : NUMBERS) {
            Object v = p.getOrDefault((String) n[0], n[1]);
            double x = v instanceof BigInteger ? ((BigInteger) v).doubleValue() : v instanceof Double ? (Double) v : Double.NaN;
            double lo = (Double) n[2], hi = (Double) n[3];
            if (!Double.isFinite(x) || x > hi || x < lo || (x == lo && !(Boolean) n[4]))
                throw bad(kind, n[0] + " must be a finite number in " + ((Boolean) n[4] ? "[" : "(") + lo + ", " + hi + "], got " + v);
            wire.put((String) n[0], v);
        }
        if (((Number) wire.get("momentum")).doubleValue() >= 1) throw bad(kind, "momentum must be < 1");
        Object seed = p.getOrDefault("seed", BigInteger.ZERO);
        if (!(seed instanceof BigInteger)) throw bad(kind, "seed must be an integer, got " + seed);
        wire.put("seed", seed);
        wire.put("local_rule", LocalTraining.rule(p));
        wire.put("sam_rho", LocalTraining.bounded(p, "sam_rho", 0.1, 100));
        wire.put("asam_eta", LocalTraining.bounded(p, "asam_eta", 0.2, 100));
        wire.put("prox_mu", LocalTraining.bounded(p, "prox_mu", 0.0, 1e4));
    }

    /** A layout ([[name, [dims]], ...], non-empty, names distinct, dims integers >= 0, at most
     *  MAX_PARAMETERS values), as written. */
    static List<Object> layout(Object value, String kind, String what) throws TaskDeclined {
        if (!(value instanceof List) || ((List<?>) value).isEmpty()) throw bad(kind, what + " must be a non-empty list of [name, shape]");
        Set<String> seen = new HashSet<>();
        BigInteger total = BigInteger.ZERO;
        for (Object item : (List<?>) value) {
            if (!(item instanceof List) || ((List<?>) item).size() != 2 || !(((List<?>) item).get(0) instanceof String)
                    || !(((List<?>) item).get(1) instanceof List))
                throw bad(kind, what + ": bad layout entry " + item);
            BigInteger size = BigInteger.ONE;
            for (Object dim : (List<?>) ((List<?>) item).get(1)) {
                if (!(dim instanceof BigInteger) || ((BigInteger) dim).signum() < 0) throw bad(kind, what + ": bad layout entry " + item);
                size = size.multiply((BigInteger) dim);
            }
            if (!seen.add((String) ((List<?>) item).get(0))) throw bad(kind, what + ": duplicate layout name " + ((List<?>) item).get(0));
            total = total.add(size);
        }
        if (total.compareTo(BigInteger.valueOf(MAX_PARAMETERS)) > 0)
            throw bad(kind, what + ": layout holds " + total + " values, more than " + MAX_PARAMETERS);
        @SuppressWarnings("unchecked") List<Object> out = (List<Object>) value;
        return out;
    }

    /** sha256 hex of Python's json.dumps(v, sort_keys=True, separators=(",", ":")) (ladd.py layout_digest). */
    static String digest(Object v) throws TaskDeclined {
        try {
            return Envelope.hex(Envelope.sha256(Json.canonicalAscii(v)));
        } catch (Json.JsonError e) {
            throw new TaskDeclined("bad task params: " + e.getMessage());
        }
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = new LinkedHashMap<>(wire);
        out.put(TaskParams.VERSION_KEY, TaskParams.VERSION);
        return out;
    }
}
