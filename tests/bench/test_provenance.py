from __future__ import annotations

from pathlib import Path

from dlora.bench import provenance
from dlora.bench.provenance import cpu_extensions, machine, parse_cpuinfo

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2
"""

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""

NO_FLAGS = """processor\t: 0
model name\t: Some CPU
"""


def test_epyc_with_avx2_only():
    model, flags = parse_cpuinfo(EPYC)
    assert model == "AMD EPYC 7B13"
    assert cpu_extensions(flags) == ["AVX2"]


def test_xeon_with_avx512_bf16_and_amx():
    model, flags = parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpu_extensions(flags) == ["AMX", "AMX-BF16", "AVX-512", "AVX2", "AVX512-BF16"]


def test_no_flags_line_means_no_extensions():
    model, flags = parse_cpuinfo(NO_FLAGS)
    assert (model, flags) == ("Some CPU", set())
    assert cpu_extensions(flags) == []
    assert parse_cpuinfo("") == (None, set())


def test_cpu_extensions_ignores_lookalike_flags():
    # Only the exact flags count: avx is not AVX2, avx512bw is not AVX-512, amx_int8 is not AMX.
    assert cpu_extensions({"avx", "avx512bw", "amx_int8"}) == []


def test_machine_on_this_machine_records_cpu_model_and_extensions():
    m = machine()
    assert {"cpu_model", "cpu_extensions", "cores"} <= m.keys()
    assert isinstance(m["cpu_model"], str)
    assert m["cpu_extensions"] == sorted(m["cpu_extensions"])
    assert set(m["cpu_extensions"]) <= set(provenance.CPU_EXTENSIONS.values())


def test_machine_without_proc_cpuinfo_falls_back_to_platform(monkeypatch):
    real_read_text = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        if str(self) == "/proc/cpuinfo":
            raise FileNotFoundError(self)
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(provenance.platform, "processor", lambda: "arm")
    m = machine()
    assert m["cpu_model"] == "arm"
    assert m["cpu_extensions"] == []
