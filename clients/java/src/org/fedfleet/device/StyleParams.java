// ladd.style params (protocols/payloads/ladd.py StyleParams): the spectrum window's half-width b
// (0..8) and the resize before the FFT (16..1024), both required. This library does not serve
// ladd.style; it reads the params exactly as the Python device does (golden params).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.LinkedHashMap;
import java.util.Map;

public final class StyleParams {
    static final String KIND = "ladd.style";
    final int b, imageSize;

    private StyleParams(Map<String, Object> p) throws TaskDeclined {
        TaskParams.checkVersion(p, KIND);
        TaskParams.require(p, KIND, "b", "image_size");
        b = (int) Params.integer(p, "b", 0, 8);
        imageSize = (int) Params.integer(p, "image_size", 16, 1024);
    }

    public static StyleParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new StyleParams(params);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("b", BigInteger.valueOf(b));
        out.put("image_size", BigInteger.valueOf(imageSize));
        out.put(TaskParams.VERSION_KEY, TaskParams.VERSION);
        return out;
    }
}
