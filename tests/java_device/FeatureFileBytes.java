// What the Java device makes of feature files (org.fedfleet.device.FeatureFile.read), for
// tests/test_java_feature_file.py. One file path per line on stdin; prints one line per file:
// "OK <n> <d> <row-major floats, comma-separated> <labels, comma-separated>" or "REFUSED <why>"
// ("CRASH <what>": anything else escaping, a bug).
import org.fedfleet.device.FeatureFile;

public final class FeatureFileBytes {
    public static void main(String[] args) throws Exception {
        StdinCases.eachPath(path -> {
            FeatureFile f = FeatureFile.read(path);
            StringBuilder values = new StringBuilder(), labels = new StringBuilder();
            for (int i = 0; i < f.n; i++) {
                for (float v : f.input(i)) values.append(values.length() == 0 ? "" : ",").append(v);
                labels.append(i == 0 ? "" : ",").append(f.label(i));
            }
            return "OK " + f.n + " " + f.dim + " " + values + " " + labels;
        });
    }
}
