"""A C++ fused bias+ReLU kernel that works on raw float pointers, registered through
``torch.library`` (built once with ``load_inline``, then loaded from the build cache)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>

torch::Tensor fused_bias_relu(const torch::Tensor& x, const torch::Tensor& b) {
  TORCH_CHECK(x.dim() == 2 && b.dim() == 1 && x.size(1) == b.size(0),
              "fused_bias_relu: expected x [m, n] and b [n]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && b.scalar_type() == torch::kFloat,
              "fused_bias_relu: float32 only");
  auto xc = x.contiguous();
  auto bc = b.contiguous();
  auto out = torch::empty_like(xc);
  const float* px = xc.data_ptr<float>();
  const float* pb = bc.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t m = xc.size(0), n = xc.size(1);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float v = px[i * n + j] + pb[j];
      po[i * n + j] = v > 0.f ? v : 0.f;
    }
  return out;
}

torch::Tensor fused_bias_relu_backward(const torch::Tensor& grad, const torch::Tensor& out) {
  auto g = grad.contiguous();
  auto o = out.contiguous();
  auto gx = torch::empty_like(g);
  const float* pg = g.data_ptr<float>();
  const float* po = o.data_ptr<float>();
  float* px = gx.data_ptr<float>();
  for (int64_t i = 0; i < g.numel(); ++i) px[i] = po[i] > 0.f ? pg[i] : 0.f;
  return gx;
}

TORCH_LIBRARY(vescale_test, m) {
  m.def("fused_bias_relu(Tensor x, Tensor b) -> Tensor");
  m.def("fused_bias_relu_backward(Tensor grad, Tensor out) -> Tensor");
}

TORCH_LIBRARY_IMPL(vescale_test, CPU, m) {
  m.impl("fused_bias_relu", &fused_bias_relu);
  m.impl("fused_bias_relu_backward", &fused_bias_relu_backward);
}
"""

BUILD_DIR = Path(
    os.environ.get("VESCALE_TEST_EXT_DIR", Path.home() / ".cache" / "vescale_test_ext")
)
_loaded = False


def load() -> None:
    """Build (first call on a machine) or load the extension and register its Python parts."""
    global _loaded
    if _loaded:
        return
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    load_inline(
        "vescale_fused_bias_relu",
        cpp_sources=CPP,
        is_python_module=False,
        build_directory=str(BUILD_DIR),
        extra_cflags=["-O2"],
    )
    ops = torch.ops.vescale_test

    @torch.library.register_fake("vescale_test::fused_bias_relu")
    def _(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("vescale_test::fused_bias_relu_backward")
    def _(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(grad)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        gx = ops.fused_bias_relu_backward(grad, out)
        return gx, gx.sum(0)

    torch.library.register_autograd(
        "vescale_test::fused_bias_relu", backward, setup_context=setup_context
    )
    _loaded = True
