"""Semantic segmentation network for LADD: MobileNetV2 encoder (ImageNet) + a light DeepLabV3 head.

Layout (parameter-name prefixes matter: they say what is frozen, trained and exchanged)::

    encoder.*   MobileNetV2 ``features[:cut - tail_blocks]``, ImageNet weights, always frozen.
                A device computes these features once per image and caches them.
    tail.*      the encoder's last ``tail_blocks`` inverted-residual blocks before the cut
                (ImageNet-initialised; convolutions trainable, BatchNorm frozen)
    head.*      ASPP-lite (1×1 conv, 3×3 atrous convs at ``aspp_rates``, image pooling)
                -> 1×1 projection -> 3×3 conv -> 1×1 classifier; BatchNorm after each conv

``cut`` is 7 for output stride 8 (32 channels) or 14 for stride 16 (96 channels): the
encoder is truncated at an intermediate stage, which keeps the maps large enough for small
images and the compute small. Logits are upsampled to the input size by a fixed bilinear
interpolation written as two matrix products (:class:`BilinearUpsample`), equal to
``F.interpolate(..., mode="bilinear", align_corners=False)``; matrix products keep the
exported training program within ops whose backward every runtime has.

What travels between server and devices is :meth:`SegmentationModel.exchanged_state`, the
``tail.*`` and ``head.*`` entries of the state dict (parameters and BN buffers, never the
ImageNet encoder, which every device already has and verifies by sha256). On the device,
BatchNorm is frozen (eval mode: running statistics, affine parameters not trained), so only
convolution weights and biases are trainable (:meth:`trainable_names`).

:class:`SelfTrainingStep` is the on-device training computation (loss first, as ExecuTorch
training programs require): LADD's L = L_pseudo + λ_KD · L_KD on cached encoder features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from edge_client.models import build_backbone
from edge_client.models.preprocess import to_model_input

__all__ = ["BilinearUpsample", "SegmentationModel", "SegmentationSpec", "SelfTrainingStep",
           "bilinear_matrix", "lower_self_training_program", "self_training_loss"]

ENCODER_BACKBONE = "mobilenet_v2"
_CUT = {8: 7, 16: 14}                    # output stride -> index of the first block not used
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)
IGNORE = 255
TRAINABLE_SCOPES = ("head", "tail+head")
EXCHANGED_PREFIXES = ("tail.", "head.")
MAX_ASPP_RATES, MAX_ASPP_RATE = 8, 64         # as a LADD job's config takes them


@dataclasses.dataclass(frozen=True)
class SegmentationSpec:
    """Everything both sides must agree on to build the same network."""

    num_classes: int
    image_size: int = 64
    output_stride: int = 8
    tail_blocks: int = 2
    head_channels: int = 64
    aspp_rates: tuple[int, ...] = (2, 4)

    def __post_init__(self):
        # integers as sent, at most MAX_ASPP_RATES of them up to MAX_ASPP_RATE (the job config's
        # bounds): 300 branches built ~1 GB before the layout check, and 2.9 ran as 2 (a review)
        rates = tuple(self.aspp_rates)
        if not 1 <= len(rates) <= MAX_ASPP_RATES or any(
                isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 1 <= r <= MAX_ASPP_RATE for r in rates):
            raise ValueError(f"aspp_rates must be 1 to {MAX_ASPP_RATES} integers in [1, {MAX_ASPP_RATE}], "
                             f"got {str(list(rates))[:100]}")
        object.__setattr__(self, "aspp_rates", tuple(int(r) for r in rates))
        if self.output_stride not in _CUT:
            raise ValueError(f"output_stride must be one of {sorted(_CUT)}, got {self.output_stride}")
        if not 1 <= self.num_classes <= 254:
            raise ValueError(f"num_classes must be in [1, 254] (255 is the ignore label), got {self.num_classes}")
        if not 0 <= self.tail_blocks <= 4:
            raise ValueError(f"tail_blocks must be in [0, 4], got {self.tail_blocks}")
        if not 16 <= self.image_size <= 1024 or not 4 <= self.head_channels <= 512:
            raise ValueError("image_size must be in [16, 1024] and head_channels in [4, 512]")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "aspp_rates": list(self.aspp_rates)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SegmentationSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown segmentation spec fields {sorted(unknown)}")
        return cls(**dict(d))


def bilinear_matrix(in_size: int, out_size: int) -> np.ndarray:
    """(out, in) matrix of 1-D bilinear resizing with half-pixel centres (align_corners=False)."""
    scale = in_size / out_size
    src = np.clip((np.arange(out_size) + 0.5) * scale - 0.5, 0, None)
    lo = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = src - lo
    A = np.zeros((out_size, in_size), np.float64)
    A[np.arange(out_size), lo] += 1 - frac
    A[np.arange(out_size), hi] += frac
    return A.astype(np.float32)


class BilinearUpsample(nn.Module):
    """(N, C, h, w) -> (N, C, H, W) as A_h · X · A_wᵀ (fixed, non-persistent buffers)."""

    def __init__(self, in_hw: tuple[int, int], out_hw: tuple[int, int]):
        super().__init__()
        self.register_buffer("rows", torch.from_numpy(bilinear_matrix(in_hw[0], out_hw[0])), persistent=False)
        self.register_buffer("cols", torch.from_numpy(bilinear_matrix(in_hw[1], out_hw[1]).T.copy()),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(torch.matmul(self.rows, x), self.cols)


def _conv_bn_relu(cin: int, cout: int, kernel: int = 1, dilation: int = 1) -> nn.Sequential:
    pad = dilation * (kernel - 1) // 2
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, padding=pad, dilation=dilation, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class AsppLite(nn.Module):
    """DeepLabV3's ASPP with fewer, narrower branches: 1×1, atrous 3×3 per rate, image pooling."""

    def __init__(self, cin: int, cout: int, rates: Iterable[int]):
        super().__init__()
        self.branches = nn.ModuleList([_conv_bn_relu(cin, cout, 1)] +
                                      [_conv_bn_relu(cin, cout, 3, r) for r in rates])
        self.pool = _conv_bn_relu(cin, cout, 1)
        self.project = _conv_bn_relu(cout * (len(self.branches) + 1), cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(x.mean(dim=(2, 3), keepdim=True)).expand(-1, -1, x.shape[2], x.shape[3])
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], dim=1))


class SegmentationHead(nn.Module):
    def __init__(self, cin: int, channels: int, num_classes: int, rates: Iterable[int]):
        super().__init__()
        self.aspp = AsppLite(cin, channels, rates)
        self.refine = _conv_bn_relu(channels, channels, 3)
        self.classifier = nn.Conv2d(channels, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.refine(self.aspp(x)))


class SegmentationModel(nn.Module):
    """Normalised (N, 3, S, S) float32 -> logits (N, C, S, S)."""

    mean, std = _MEAN, _STD

    def __init__(self, spec: SegmentationSpec, pretrained_encoder: bool = True, seed: int = 0):
        super().__init__()
        self.spec = spec
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # the head's random init is a function of the seed
            features = build_backbone(ENCODER_BACKBONE, pretrained=pretrained_encoder).features
            cut = _CUT[spec.output_stride]
            self.encoder = nn.Sequential(*features[:cut - spec.tail_blocks])
            self.tail = nn.Sequential(*features[cut - spec.tail_blocks:cut])
            with torch.no_grad():
                probe = self.tail(self.encoder(torch.zeros(1, 3, spec.image_size, spec.image_size)))
            self.feature_hw = tuple(probe.shape[2:])
            self.head = SegmentationHead(probe.shape[1], spec.head_channels, spec.num_classes, spec.aspp_rates)
        self.upsample = BilinearUpsample(self.feature_hw, (spec.image_size, spec.image_size))
        self.encoder.requires_grad_(False)
        self.eval()

    # --------------------------------------------------------------- forward passes
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits_from_features(self.encoder(x))

    def logits_from_features(self, frozen: torch.Tensor) -> torch.Tensor:
        """Logits from the output of the frozen encoder (what devices cache)."""
        return self.upsample(self.head(self.tail(frozen)))

    def train(self, mode: bool = True) -> "SegmentationModel":
        super().train(mode)
        self.encoder.eval()  # ImageNet BatchNorm statistics are never re-estimated
        return self

    def preprocess(self, images: np.ndarray) -> np.ndarray:
        """uint8 (N, S, S, 3) -> normalised float32 (N, 3, S, S)."""
        return to_model_input(images, self.spec.image_size, self.mean, self.std)

    @torch.no_grad()
    def frozen_features(self, images: np.ndarray, batch: int = 64) -> torch.Tensor:
        """Encoder output for uint8 images, computed in batches (cacheable: the encoder never changes)."""
        x = self.preprocess(images)
        return torch.cat([self.encoder(torch.from_numpy(x[i:i + batch])) for i in range(0, len(x), batch)])

    @torch.no_grad()
    def predict_logits(self, frozen: torch.Tensor, batch: int = 64) -> torch.Tensor:
        was = self.training
        self.eval()
        out = torch.cat([self.logits_from_features(frozen[i:i + batch]) for i in range(0, len(frozen), batch)])
        self.train(was)
        return out

    # --------------------------------------------------------------- parameters on the wire
    def exchanged_state(self) -> dict[str, np.ndarray]:
        """tail.* and head.* parameters and BN statistics as float32 numpy (what server and devices swap)."""
        return {k: v.detach().cpu().numpy().astype(np.float32, copy=True)
                for k, v in self.state_dict().items()
                if k.startswith(EXCHANGED_PREFIXES) and not k.endswith("num_batches_tracked")}

    def load_exchanged(self, arrays: Mapping[str, np.ndarray], strict: bool = True) -> None:
        state = self.state_dict()
        expected = set(self.exchanged_state())
        if strict and set(arrays) != expected:
            raise ValueError(f"exchanged state mismatch: missing {sorted(expected - set(arrays))[:5]}, "
                             f"unexpected {sorted(set(arrays) - expected)[:5]}")
        with torch.no_grad():
            for name, value in arrays.items():
                if name not in expected:
                    raise ValueError(f"{name!r} is not an exchanged tensor")
                value = np.asarray(value)
                if tuple(value.shape) != tuple(state[name].shape):
                    raise ValueError(f"{name}: shape {value.shape}, model has {tuple(state[name].shape)}")
                state[name].copy_(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)))

    def trainable_names(self, scope: str = "tail+head") -> list[str]:
        """Convolution weights/biases of the scope, in state-dict order (BatchNorm excluded: frozen)."""
        if scope not in TRAINABLE_SCOPES:
            raise ValueError(f"trainable scope must be one of {TRAINABLE_SCOPES}, got {scope!r}")
        prefixes = ("head.",) if scope == "head" else EXCHANGED_PREFIXES
        conv_params = {f"{m}.{p}" for m, mod in self.named_modules() if isinstance(mod, nn.Conv2d)
                       for p, _ in mod.named_parameters(recurse=False)}
        return [n for n, _ in self.named_parameters() if n in conv_params and n.startswith(prefixes)]

    def set_trainable(self, names: Iterable[str]) -> list[nn.Parameter]:
        names = set(names)
        params = []
        for n, p in self.named_parameters():
            p.requires_grad_(n in names)
            if n in names:
                params.append(p)
        if len(params) != len(names):
            raise ValueError(f"unknown parameter names {sorted(names - {n for n, _ in self.named_parameters()})}")
        return params


def self_training_loss(logits: torch.Tensor, pseudo: torch.Tensor, kd_probs: torch.Tensor,
                       kd_mask: torch.Tensor, kd_lambda: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LADD's local objective (spec §2.4, the normalisation of the authors' code).

    * L_pseudo = Σ_{p kept} −log softmax(z_p)[ỹ_p] / (N·H·W): ignored pixels (ỹ = 255) add 0
      but still count in the denominator.
    * L_KD = −(1/(N·H·W)) Σ_p m_p · (1/C) Σ_c q_pc log softmax(z_p)_c with q the (already
      tempered) soft predictions of the frozen pre-trained model and m its own pseudo-label mask.

    Returns (L, L_pseudo, L_KD). ``pseudo`` is int64 (N, H, W) with 255 for ignored pixels.
    """
    logp = F.log_softmax(logits, dim=1)
    keep = pseudo != IGNORE
    index = torch.where(keep, pseudo, torch.zeros_like(pseudo)).unsqueeze(1)
    nll = -torch.gather(logp, 1, index).squeeze(1)
    pixels = float(pseudo.numel())
    l_pseudo = (nll * keep.to(nll.dtype)).sum() / pixels
    l_kd = -((kd_probs * logp).mean(dim=1) * kd_mask).sum() / pixels
    return l_pseudo + kd_lambda * l_kd, l_pseudo, l_kd


class SelfTrainingStep(nn.Module):
    """The trainable computation of one device step: (loss, logits) from cached encoder features.

    Inputs: ``frozen`` (N, c, h, w) encoder features, ``pseudo`` (N, S, S) int64 pseudo-labels
    (255 = ignore), ``kd_probs`` (N, C, S, S) soft targets of the pre-trained model,
    ``kd_mask`` (N, S, S) float 0/1. BatchNorm runs in eval mode (frozen on device).
    """

    def __init__(self, model: SegmentationModel, kd_lambda: float):
        super().__init__()
        self.model = model
        self.kd_lambda = float(kd_lambda)

    def train(self, mode: bool = True) -> "SelfTrainingStep":
        return super().train(False)     # BatchNorm frozen on device

    def forward(self, frozen: torch.Tensor, pseudo: torch.Tensor, kd_probs: torch.Tensor,
                kd_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.logits_from_features(frozen)
        loss, _, _ = self_training_loss(logits, pseudo, kd_probs, kd_mask, self.kd_lambda)
        return loss, logits.detach()


def lower_self_training_program(model: SegmentationModel, trainable: Iterable[str], batch: int,
                                kd_lambda: float) -> bytes:
    """``.pte`` bytes of :class:`SelfTrainingStep` as an ExecuTorch training program (joint
    forward + backward) for batches of exactly ``batch`` images.

    The program's parameters are the ``trainable`` tensors (set and read through the training
    module); every other tensor (frozen convolutions, BatchNorm statistics) is baked in with
    its current value, so a program belongs to one frozen state. Needs ``executorch.exir``.
    """
    from executorch.exir import EdgeCompileConfig, to_edge
    from torch.export.experimental import _export_forward_backward

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    spec = model.spec
    frozen = torch.zeros((batch, *_frozen_shape(model)))
    example = (frozen, torch.zeros(batch, spec.image_size, spec.image_size, dtype=torch.int64),
               torch.full((batch, spec.num_classes, spec.image_size, spec.image_size), 1.0 / spec.num_classes),
               torch.ones(batch, spec.image_size, spec.image_size))
    model.set_trainable(trainable)
    try:
        step = SelfTrainingStep(model, kd_lambda).train()
        joint = _export_forward_backward(torch.export.export(step, example, strict=True))
        # the joint graph holds loss-backward ops outside the core ATen checker's list (run by
        # the portable kernels, as in ExecuTorch's own training examples)
        return to_edge(joint, compile_config=EdgeCompileConfig(_check_ir_validity=False)).to_executorch().buffer
    finally:
        model.set_trainable(())


def _frozen_shape(model: SegmentationModel) -> tuple[int, ...]:
    with torch.no_grad():
        return tuple(model.encoder(torch.zeros(1, 3, model.spec.image_size, model.spec.image_size)).shape[1:])
