"""Every kernel variant Kiln launches on CUDA compiles for Hopper (sm_90)
with Triton's own CUDA backend, down to a cubin, on this CPU-only machine:
what the interpreter cannot see (bf16 `tl.dot` on tensor cores, fp8 e4m3
conversions, register and shared-memory limits) at least gets through the
real compiler. Launches are recorded from the public wrappers (so the
signatures and constexprs are the ones the GPU would get), then compiled."""
import inspect

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[cuda]' or triton)")

from kiln.llm.attention.triton_decode import decode_attention  # noqa: E402
from kiln.llm.attention.triton_kv_write import write_kv  # noqa: E402
from kiln.llm.attention.triton_prefill import prefill_attention  # noqa: E402
from kiln.llm.kernels import triton_env, triton_layers  # noqa: E402

OPTIONS = ("num_warps", "num_stages")


def record(monkeypatch, launch) -> list:
    launches = []
    monkeypatch.setattr(triton_env.Kernel, "__getitem__",
                        lambda self, grid: lambda *args, **kw: launches.append((self, args, kw)))
    launch()
    return launches


def compile_for_hopper(kernel, args, kwargs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: mangle_type(a) for name, a in zip(names, args, strict=False)}
    constexprs = {k: v for k, v in kwargs.items() if k not in OPTIONS}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    compiled = triton.compile(ASTSource(triton.jit(kernel.fn), signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    assert compiled.asm["cubin"]


def attention_launches(q_dtype, pool_dtype, group=4, head_dim=128):
    def launch():
        q = torch.empty(4, 8 * group, head_dim, dtype=q_dtype)
        pool = torch.empty(2, 64, 8, head_dim, dtype=pool_dtype)
        tables, lens = torch.zeros(4, 4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
        f32 = q_dtype == torch.float32
        for splits in (1, 4):
            decode_attention(q, pool[0], pool[1], tables, lens, 16, splits, torch.empty_like(q), dot_f32=f32)
        k = torch.empty(4, 8, head_dim, dtype=q_dtype)
        prefill_attention(q, k, k, pool[0], pool[1], lens, lens, lens, tables, 4, 16, torch.empty_like(q),
                          dot_f32=f32)
        write_kv(k, k, pool[0], pool[1], lens)

    return launch


@pytest.fixture(autouse=True)
def compiler(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set for this directory by conftest.py
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_attention_kernels_compile_for_sm90(monkeypatch, pool_dtype):
    launches = record(monkeypatch, attention_launches(torch.bfloat16, pool_dtype))
    assert [k.__name__ for k, _, _ in launches] == [
        "_decode_kernel", "_decode_kernel", "_merge_kernel", "_prefill_kernel", "_write_kv_kernel"]
    for launch in launches:
        compile_for_hopper(*launch)


def test_layer_kernels_compile_for_sm90(monkeypatch):
    def launch():
        x = torch.empty(4, 4096, dtype=torch.bfloat16)
        triton_layers.rms_norm(x, x[0], 1e-5)
        triton_layers.add_rms_norm(x, x, x[0], 1e-5)
        q, k = torch.empty(4, 32, 128, dtype=torch.bfloat16), torch.empty(4, 8, 128, dtype=torch.bfloat16)
        triton_layers.rotary_(q, k, torch.empty(4, 1, 64), torch.empty(4, 1, 64))
        triton_layers.silu_mul(torch.empty(4, 2 * 14336, dtype=torch.bfloat16))

    launches = record(monkeypatch, launch)
    assert len(launches) == 5
    for launch in launches:
        compile_for_hopper(*launch)
