// Parses the task params of a golden vector file (protocols/golden/task_params/<kind>.json) with
// the Java device's typed params class of the kind, so tests/test_task_params_contract.py can
// check that both devices accept and refuse the same params and read them the same.
// Usage: java ParamsRunner <golden file>...; prints per file "KIND <kind>", then "VALID <i> <canonical
// JSON of toParams()>" per valid case and "INVALID <i> DECLINED <reason>" or "INVALID <i> ACCEPTED"
// per invalid one.
import java.nio.file.*;
import java.util.*;
import org.fedfleet.device.*;
import org.fedfleet.wire.*;

public final class ParamsRunner {
    public static void main(String[] args) throws Exception {
        for (String path : args) run(path);          // one JVM for every kind's file
    }

    @SuppressWarnings("unchecked")
    private static void run(String path) throws Exception {
        Map<String, Object> golden = (Map<String, Object>) Json.parse(new String(Files.readAllBytes(Paths.get(path)), "UTF-8"));
        String kind = (String) golden.get("kind");
        System.out.println("KIND " + kind);
        List<?> valid = (List<?>) golden.get("valid"), invalid = (List<?>) golden.get("invalid");
        for (int i = 0; i < valid.size(); i++) {
            Map<String, Object> params = (Map<String, Object>) ((Map<String, Object>) valid.get(i)).get("params");
            System.out.println("VALID " + i + " " + new String(Json.canonical(parse(kind, params)), "UTF-8"));
        }
        for (int i = 0; i < invalid.size(); i++) {
            Map<String, Object> params = (Map<String, Object>) ((Map<String, Object>) invalid.get(i)).get("params");
            try {
                parse(kind, params);
                System.out.println("INVALID " + i + " ACCEPTED");
            } catch (TaskDeclined e) {
                System.out.println("INVALID " + i + " DECLINED " + e.getMessage());
            }
        }
    }

    private static Map<String, Object> parse(String kind, Map<String, Object> params) throws TaskDeclined {
        switch (kind) {
            case "fed3r.stats": return Fed3RStatsParams.fromParams(params).toParams();
            case "fedavg.head": return HeadTrainingParams.fromParams(params).toParams();
            case "oll.personalize": return PersonalizeParams.fromParams(params).toParams();
            case "fed3r.secure": return SecureFed3RParams.fromParams(params).toParams();
            case "fedavg.secure": return SecureFedAvgParams.fromParams(params).toParams();
            case "fedavg.tail": return TailTrainingParams.fromParams(params).toParams();
            case "scaffold.head": return StatefulHeadParams.scaffold(params).toParams();
            case "scaffold.tail": return ScaffoldTailParams.fromParams(params).toParams();
            case "ditto.head": return DittoParams.fromParams(params).toParams();
            case "pp.head": return PartialParams.fromParams(params).toParams();
            case "fedgloss.head": return FedGlossParams.fromParams(params).toParams();
            case "ladd.style": return StyleParams.fromParams(params).toParams();
            case "fedavg.tail.secure": return SecureTailParams.fromParams(params).toParams();
            case "pp.head.secure": return SecurePartialParams.fromParams(params).toParams();
            case "scaffold.head.secure": return SecureScaffoldParams.fromParams(params).toParams();
            case "ditto.head.secure": return SecureDittoParams.fromParams(params).toParams();
            case "ladd.train": return LaddTrainParams.fromParams(params).toParams();
            case "ladd.train.secure": return SecureLaddParams.fromParams(params).toParams();
            default: throw new IllegalArgumentException("no typed params for " + kind);
        }
    }
}
