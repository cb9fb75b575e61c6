"""The machine line of the benchmarks (``s2s_daemon/bench/machine.py``) on other machines' ``lscpu``,
``/proc/cpuinfo``, ``/proc/stat`` and ``/proc/meminfo``: an AVX2-only AMD EPYC, an Intel Xeon with
AMX, ARM servers, and a hypervisor that names no model."""

from __future__ import annotations

import re

import pytest

from s2s_daemon.bench.machine import (
    CpuTimes,
    cpu_from_cpuinfo,
    cpu_from_lscpu,
    cpu_times,
    describe,
    machine_info,
    machine_line,
    memory_gib,
    steal_percent,
)

EPYC_AVX2_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
    "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid "
    "extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx "
    "f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw "
    "topoext ssbd ibrs ibpb stibp vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 rdseed adx smap "
    "clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr arat npt nrip_save umip rdpid"
)
XEON_SPR_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss "
    "ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid "
    "tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx "
    "f16c rdrand hypervisor lahf_lm abm 3dnowprefetch ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase "
    "tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm avx512f avx512dq rdseed adx smap avx512ifma "
    "clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni "
    "avx512_bf16 arat avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni "
    "avx512_bitalg avx512_vpopcntdq la57 rdpid cldemote movdiri movdir64b fsrm md_clear serialize "
    "tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 arch_capabilities"
)
GRAVITON2_FLAGS = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"
)
GRAVITON3_FLAGS = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc "
    "dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm "
    "svebf16 i8mm bf16 dgh rng"
)

EPYC_AVX2_LSCPU = f"""\
Architecture:                       x86_64
CPU op-mode(s):                     32-bit, 64-bit
CPU(s):                             2
On-line CPU(s) list:                0,1
Vendor ID:                          AuthenticAMD
Model name:                         AMD EPYC 7B12
CPU family:                         23
Model:                              49
Thread(s) per core:                 2
Core(s) per socket:                 1
Socket(s):                          1
Stepping:                           0
BogoMIPS:                           4499.99
Flags:                              {EPYC_AVX2_FLAGS}
Hypervisor vendor:                  KVM
Virtualization type:                full
L1d cache:                          32 KiB (1 instance)
"""

XEON_SPR_CPUINFO = f"""\
processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
stepping	: 8
cpu MHz		: 2699.998
cache size	: 107520 KB
physical id	: 0
siblings	: 2
core id		: 0
cpu cores	: 1
flags		: {XEON_SPR_FLAGS}
bugs		: spectre_v1 spectre_v2 spec_store_bypass swapgs eibrs_pbrsb
bogomips	: 5399.99

processor	: 1
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags		: fpu
"""

GRAVITON2_LSCPU = f"""\
Architecture:                    aarch64
CPU op-mode(s):                  32-bit, 64-bit
Byte Order:                      Little Endian
CPU(s):                          2
On-line CPU(s) list:             0,1
Vendor ID:                       ARM
Model name:                      Neoverse-N1
Model:                           1
Thread(s) per core:              1
Core(s) per socket:              2
Stepping:                        r3p1
BogoMIPS:                        243.75
Flags:                           {GRAVITON2_FLAGS}
"""

GRAVITON3_CPUINFO = f"""\
processor	: 0
BogoMIPS	: 2100.00
Features	: {GRAVITON3_FLAGS}
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x1
CPU part	: 0xd40
CPU revision	: 1
"""

HIDDEN_MODEL_CPUINFO = """\
processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 26
model		: 2
model name	: AMD EPYC
flags		: fpu avx2 fma hypervisor avx512f avx512_bf16 avx512_vnni
"""


def test_an_avx2_only_epyc_shows_avx2_and_fma_and_nothing_wider() -> None:
    cpu = cpu_from_lscpu(EPYC_AVX2_LSCPU)
    assert cpu is not None
    assert cpu.model == "AMD EPYC 7B12"
    assert cpu.isa == ["avx2", "fma"]
    assert cpu.hypervisor == "KVM"


def test_a_xeon_with_amx_shows_every_wide_feature_from_proc_cpuinfo() -> None:
    cpu = cpu_from_cpuinfo(XEON_SPR_CPUINFO)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpu.isa == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx"]
    assert cpu.hypervisor == "guest"  # /proc/cpuinfo says only that it is one


def test_an_arm_server_from_lscpu_names_the_vendor_and_its_simd() -> None:
    cpu = cpu_from_lscpu(GRAVITON2_LSCPU)
    assert cpu is not None
    assert cpu.model == "ARM Neoverse-N1"
    assert cpu.isa == ["asimd", "asimddp"]
    assert cpu.hypervisor is None


def test_an_arm_server_from_proc_cpuinfo_names_its_part_and_its_sve() -> None:
    cpu = cpu_from_cpuinfo(GRAVITON3_CPUINFO)
    assert cpu.model == "ARM CPU (implementer 0x41, part 0xd40)"
    assert cpu.isa == ["asimd", "asimddp", "i8mm", "bf16", "sve"]


def test_a_model_name_without_a_number_gets_its_family_and_model() -> None:
    assert cpu_from_cpuinfo(HIDDEN_MODEL_CPUINFO).model == "AMD EPYC (family 26, model 2)"
    lscpu = "Vendor ID: AuthenticAMD\nModel name: AMD EPYC\nCPU family: 26\nModel: 2\nFlags: avx2 fma\n"
    found = cpu_from_lscpu(lscpu)
    assert found is not None and found.model == "AMD EPYC (family 26, model 2)"


def test_lscpu_without_a_model_name_defers_to_proc_cpuinfo() -> None:
    assert cpu_from_lscpu("Architecture: aarch64\nCPU(s): 4\n") is None
    assert cpu_from_lscpu("") is None


def test_big_little_arm_lists_each_kind_of_core() -> None:
    lscpu = "Vendor ID: ARM\nModel name: Cortex-A53\nModel name: Cortex-A72\nFlags: fp asimd\n"
    found = cpu_from_lscpu(lscpu)
    assert found is not None and found.model == "ARM Cortex-A53 + Cortex-A72"


def test_steal_is_the_stolen_share_of_the_ticks_between_two_readings() -> None:
    before = cpu_times("cpu  50749 0 14737 41250 244 0 143 158 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    after = cpu_times("cpu  50849 0 14837 41350 244 0 143 258 0 0\n")
    assert before == CpuTimes(total=107281, steal=158)
    assert after == CpuTimes(total=107681, steal=258)
    assert steal_percent(before, after) == pytest.approx(25.0)
    assert steal_percent(after, after) is None  # no time between them
    assert steal_percent(None, after) is None
    assert cpu_times("intr 1 2 3\n") is None


def test_memory_is_memtotal_in_gib() -> None:
    assert memory_gib("MemTotal:       24683568 kB\nMemFree:         9007820 kB\n") == 23.5
    assert memory_gib("") is None


FAKE = {
    "platform": "Linux",
    "machine": "x86_64",
    "cpu": "AMD EPYC 7B12",
    "isa": ["avx2", "fma"],
    "hypervisor": "KVM",
    "logical_cores": 2,
    "memory_gib": 7.8,
    "python": "3.11.2",
    "load_average": [1.5, 1.0, 0.5],
    "load_at_start": 0.25,
    "steal_pct": 2.345,
}


def test_the_line_for_a_scripts_output_has_the_minute_cpu_isa_cores_memory_load_steal_then_details() -> None:
    line = machine_line("2 threads", "int8", info=FAKE)
    stamp, _, rest = line.partition(" ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d", stamp), line
    assert rest == "AMD EPYC 7B12 with avx2 fma, 2 cores, 7.8 GiB, load 1.50, steal 2.3%, 2 threads, int8"


def test_the_sentence_for_the_page_has_the_load_at_start_and_end_and_the_steal() -> None:
    assert describe(FAKE) == (
        "AMD EPYC 7B12 with avx2 fma, KVM guest, 2 CPUs, 7.8 GiB RAM, load 0.25 at the start, 1.50 at the end,"
        " steal 2.3% of CPU time"
    )
    bare = {**FAKE, "isa": [], "hypervisor": None, "memory_gib": None, "load_at_start": None, "steal_pct": None}
    assert describe(bare) == "AMD EPYC 7B12, 2 CPUs, load 1.50 at the end"


@pytest.mark.integration
def test_this_machine_is_described_with_what_the_json_documents_carried_before() -> None:
    info = machine_info()
    assert {"platform", "machine", "cpu", "logical_cores", "memory_gib", "python", "load_average"} <= set(info)
    assert info["cpu"] and info["logical_cores"] >= 1
    assert isinstance(info["isa"], list)
