"""What folding BatchNorm before export saves (``export/batch_norm_folding.py``), per backbone
(MobileNetV2: folded through fx; EfficientNet-Lite0: from a forward pass): its inference program
lowered to XNNPACK, exported to ONNX, and quantized to int8 then lowered, from the eval model as
it is and from its folded copy, in one run: CPU-seconds of each export (this process's), the
programs' sizes and delegate calls, and the folded model's largest difference from the unfolded
model's outputs (the export's parity tolerance is 1e-4).

    .venv/bin/python bench/export_folding.py [--image-size 32] [--backbones mobilenet_v2 efficientnet_lite0]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from edge_client.models import build_backbone  # noqa: E402
from export.batch_norm_folding import fold_batch_norms  # noqa: E402
from export.executorch_export import lower_inference_program  # noqa: E402
from export.onnx_export import export_onnx_model  # noqa: E402
from export.quantization import quantize_int8  # noqa: E402


def cpu_of(step):
    t0 = time.process_time()
    result = step()
    return time.process_time() - t0, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--backbones", nargs="+", default=["mobilenet_v2", "efficientnet_lite0"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    example = torch.randn(8, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(0))
    calibration = torch.randn(16, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(1))
    for backbone in args.backbones:
        model = build_backbone(backbone).eval()
        fold_s, folded = cpu_of(lambda: fold_batch_norms(model, example))
        with torch.no_grad():
            difference = (folded(example) - model(example)).abs().max().item()
        rows = {}
        for name, m in (("as is", model), ("folded", folded)):
            lower_s, program = cpu_of(lambda: lower_inference_program(m, example, 8))
            onnx_s, onnx_model = cpu_of(lambda: export_onnx_model(m, example, "input", "features"))
            int8_s, int8 = cpu_of(lambda: lower_inference_program(quantize_int8(m, example, calibration, 8),
                                                                  example, 8))
            rows[name] = (lower_s, onnx_s, int8_s)
            print(f"{backbone} {name:>6}: XNNPACK lowering {lower_s:5.1f} CPU-s ({len(program.buffer) / 1e6:.2f} MB, "
                  f"{program.delegate_calls} delegate call(s)), ONNX export {onnx_s:4.1f} CPU-s "
                  f"({len(onnx_model.buffer) / 1e6:.2f} MB), int8 quantization and lowering {int8_s:5.1f} CPU-s "
                  f"({len(int8.buffer) / 1e6:.2f} MB)", flush=True)
        print(f"{backbone}: folding itself {fold_s:.2f} CPU-s; folded vs as-is outputs: max abs difference "
              f"{difference:.2g}")
        print(f"{backbone}, folded / as is: XNNPACK lowering {rows['folded'][0] / rows['as is'][0]:.2f}x, "
              f"ONNX export {rows['folded'][1] / rows['as is'][1]:.2f}x, "
              f"int8 quantization and lowering {rows['folded'][2] / rows['as is'][2]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
