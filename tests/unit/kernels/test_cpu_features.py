"""kvfleet.kernels.cpu_features on recorded /proc/cpuinfo flag sets (tests/data/cpuinfo/)."""


import pytest
from support.paths import DATA

from kvfleet.kernels import cpu_features as cf

CPUINFO = DATA / "cpuinfo"


def recorded(name: str) -> cf.CpuFeatures:
    return cf.CpuFeatures.from_cpuinfo((CPUINFO / name).read_text())


@pytest.mark.parametrize(
    ("name", "level", "native_bf16", "int8_dot"),
    [
        ("avx2_epyc_zen3.txt", "avx2", False, "avx2"),
        ("avx512bf16_epyc_zen4.txt", "avx512_bf16", True, "avx512_vnni"),
        ("amx_xeon_sapphire_rapids.txt", "amx", True, "avx512_vnni"),
    ],
)
def test_levels_of_recorded_machines(name, level, native_bf16, int8_dot):
    f = recorded(name)
    assert f.isa_level == level
    assert f.native_bf16 is native_bf16
    assert f.int8_dot == int8_dot
    assert f.model_name and level in f.summary()


def test_below_the_floor_and_off_x86():
    assert cf.CpuFeatures.from_cpuinfo("flags\t: fpu sse2 avx fma f16c\n").isa_level is None
    assert cf.CpuFeatures.from_cpuinfo("").isa_level is None
    zen4 = (CPUINFO / "avx512bf16_epyc_zen4.txt").read_text()
    arm = cf.CpuFeatures.from_cpuinfo(zen4, x86_64=False)
    assert arm.isa_level is None and not arm.native_bf16 and arm.int8_dot is None


def test_a_level_needs_every_level_below_it():
    # avx512_bf16 without the AVX-512 foundation flags is not the avx512_bf16 level
    f = cf.CpuFeatures.from_cpuinfo("flags\t: avx2 fma f16c avx512_bf16 avx512_vnni\n")
    assert f.isa_level == "avx2"


def test_capping_removes_the_wider_paths():
    spr = recorded("amx_xeon_sapphire_rapids.txt")
    assert spr.capped("avx512_bf16").isa_level == "avx512_bf16"
    assert not spr.capped("avx512").native_bf16
    floor = spr.capped("avx2")
    assert floor.isa_level == "avx2" and floor.int8_dot == "avx2" and not floor.native_bf16
    assert spr.capped(None) is spr
    with pytest.raises(ValueError, match="KVFLEET_CPU_ISA"):
        spr.capped("sse4")


def test_detect_honours_the_env_cap(monkeypatch):
    machine = cf._read_machine()
    monkeypatch.setenv(cf.ISA_ENV, "avx2")
    got = cf.detect()
    assert got.isa_level == ("avx2" if machine.isa_level else None)
    monkeypatch.delenv(cf.ISA_ENV)
    assert cf.detect() == machine
