"""The kernel build: every ISA build compiled, in parallel, and a failed
compile reported with a non-zero status while the others are kept."""
import pytest

from kiln.llm.kernels import build


def test_each_isa_build_has_its_flags_and_sources():
    assert set(build.BUILDS) == {"avx2", "avx512", "avx512_vnni", "avx512_bf16"}
    avx2, avx512 = build.BUILDS["avx2"], build.BUILDS["avx512_bf16"]
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(avx2.flags) and not any("avx512" in f for f in avx2.flags)
    # AVX-512 without BF16 or VNNI (Skylake-SP has neither): the avx2 sources, sixteen lanes wide.
    plain = build.BUILDS["avx512"]
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DKILN_AVX512=1"} <= set(plain.flags)
    assert not any("bf16" in f or "vnni" in f for f in plain.flags) and plain.sources == avx2.sources
    # Cascade Lake / Ice Lake: the avx512 build plus the VNNI int8 kernel.
    vnni = build.BUILDS["avx512_vnni"]
    assert set(plain.flags) | {"-mavx512vnni", "-DKILN_VNNI=1"} == set(vnni.flags) and "bf16" not in str(vnni.flags)
    assert set(vnni.sources) - set(plain.sources) == {build.HERE / "linear_int8_vnni.cpp"}
    assert {"-mavx512bf16", "-mavx512vnni", "-DKILN_AVX512_BF16=1", "-DKILN_VNNI=1"} <= set(avx512.flags)
    assert set(avx2.sources) < set(avx512.sources)  # the bf16 dot-product kernel only where it can run
    assert all(s.exists() for s in avx512.sources)
    assert avx2.library.name == f"_kiln_kernels_avx2-{build.fingerprint(avx2)}.so"


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
    good_name, bad_name = builds[0].library.name, builds[1].library.name
    assert f"building {bad_name} FAILED" in out and f"built {good_name} in" in out
    assert (tmp_path / good_name).exists()
    assert not (tmp_path / bad_name).exists() and not list(tmp_path.glob("*.tmp.so"))
    assert build.build_all(builds[:1], tmp_path) == 0


@pytest.fixture
def empty_package(tmp_path, monkeypatch):
    """No library beside the package or in the cache: what a pip-installed wheel looks like."""
    package, cache = tmp_path / "package", tmp_path / "cache"
    package.mkdir()
    monkeypatch.setattr(build, "HERE", package)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    source = tmp_path / "probe.cpp"
    source.write_text("extern \"C\" int kiln_probe() { return 7; }\n")
    monkeypatch.setitem(build.BUILDS, "avx2", build.Build("avx2", build.AVX2_FLAGS, (source,), package))
    return package, cache / "kiln" / "kernels" / f"torch-{build.torch.__version__}"


def test_libraries_are_found_beside_the_package_or_in_the_cache(empty_package):
    package, cache = empty_package
    name = build.BUILDS["avx2"].library.name
    assert build.find_library("avx2") is None
    cache.mkdir(parents=True)
    (cache / name).write_bytes(b"")
    assert build.find_library("avx2") == cache / name
    (package / name).write_bytes(b"")
    assert build.find_library("avx2") == package / name  # `make`'s build first


def test_the_library_name_follows_the_sources_headers_flags_and_torch(empty_package, tmp_path, monkeypatch):
    avx2 = build.BUILDS["avx2"]
    first = avx2.library.name
    assert first.startswith("_kiln_kernels_avx2-") and len(first) == len("_kiln_kernels_avx2-.so") + 12
    avx2.sources[0].write_text("extern \"C\" int kiln_probe() { return 8; }\n")  # the sources changed
    second = avx2.library.name
    (tmp_path / "probe.h").write_text("#pragma once\n")  # a header beside them appeared
    third = avx2.library.name
    monkeypatch.setattr(build.torch, "__version__", "0.0.0")
    fourth = avx2.library.name
    fifth = build.Build("avx2", (*build.AVX2_FLAGS, "-DX=1"), avx2.sources, avx2.directory).library.name
    assert len({first, second, third, fourth, fifth}) == 5


def test_a_stale_library_is_never_found_and_is_named_in_the_log(empty_package, caplog):
    package, cache = empty_package
    stale = package / "_kiln_kernels_avx2-000000000000.so"  # compiled from other sources
    stale.write_bytes(b"")
    (package / "_kiln_kernels_avx2.so").write_bytes(b"")  # from before names had fingerprints
    with caplog.at_level("WARNING", logger="kiln.llm.kernels.build"):
        assert build.find_library("avx2") is None
    assert f"{stale} was compiled from other kernel sources or another torch; not loaded" in caplog.text
    assert build.BUILDS["avx2"].stale_libraries() == [stale, package / "_kiln_kernels_avx2.so"]


def test_without_a_compiler_first_use_warns_and_falls_back(empty_package, monkeypatch, caplog):
    monkeypatch.setattr(build, "compiler", lambda: None)
    build._warn_no_compiler.cache_clear()
    with caplog.at_level("WARNING", logger="kiln.llm.kernels.build"):
        assert build.build_on_first_use("avx2") is None
    build._warn_no_compiler.cache_clear()
    assert "no C++ compiler (c++ or g++) to build them; running on PyTorch's kernels" in caplog.text


@pytest.mark.skipif(build.compiler() is None or not build.cpu_supported(), reason="no C++ compiler or AVX2 CPU")
def test_first_use_compiles_once_into_the_package_or_else_the_cache(empty_package, monkeypatch, caplog):
    package, cache = empty_package
    name = build.BUILDS["avx2"].library.name
    stale = package / "_kiln_kernels_avx2-000000000000.so"
    stale.write_bytes(b"")
    with caplog.at_level("WARNING", logger="kiln.llm.kernels.build"):
        assert build.build_on_first_use("avx2") == package / name
    assert f"{name} not built; compiling it now into" in caplog.text
    assert (package / name).exists() and not stale.exists()  # the stale one is replaced
    (package / name).unlink()
    monkeypatch.setattr(build, "_writable", lambda directory: False)  # a read-only site-packages
    assert build.build_on_first_use("avx2") == cache / name
    assert build.find_library("avx2") == cache / name
