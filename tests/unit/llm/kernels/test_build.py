"""The kernel build: every ISA build compiled, in parallel, and a failed
compile reported with a non-zero status while the others are kept."""
import pytest

from kiln.llm.kernels import build


def test_each_isa_build_has_its_flags_and_sources():
    assert set(build.BUILDS) == {"avx2", "avx512_bf16"}
    avx2, avx512 = build.BUILDS["avx2"], build.BUILDS["avx512_bf16"]
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(avx2.flags) and not any("avx512" in f for f in avx2.flags)
    assert {"-mavx512bf16", "-mavx512vnni", "-DKILN_AVX512_BF16=1"} <= set(avx512.flags)
    assert set(avx2.sources) < set(avx512.sources)  # the bf16 dot-product kernel only where it can run
    assert all(s.exists() for s in avx512.sources)
    assert avx2.library.name == "_kiln_kernels_avx2.so"


def test_the_unity_source_includes_every_file_once(tmp_path):
    unit = build.unity_source(build.BUILDS["avx512_bf16"], tmp_path)
    lines = unit.read_text().splitlines()
    assert lines == [f'#include "{s}"' for s in build.BUILDS["avx512_bf16"].sources]


@pytest.mark.skipif(build.compiler() is None or not build.cpu_supported(), reason="no C++ compiler or AVX2 CPU")
def test_a_failed_compile_is_reported_and_the_others_are_kept(tmp_path, capsys):
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text("extern \"C\" int kiln_probe() { return 7; }\n")
    bad.write_text("this is not C++;\n")
    builds = [build.Build("good", build.AVX2_FLAGS, (good,), tmp_path),
              build.Build("bad", build.AVX2_FLAGS, (bad,), tmp_path)]
    assert build.build_all(builds, tmp_path) == 1
    out = capsys.readouterr().out
    assert "building _kiln_kernels_bad.so FAILED" in out and "built _kiln_kernels_good.so in" in out
    assert (tmp_path / "_kiln_kernels_good.so").exists()
    assert not (tmp_path / "_kiln_kernels_bad.so").exists() and not list(tmp_path.glob("*.tmp.so"))
    assert build.build_all(builds[:1], tmp_path) == 0
