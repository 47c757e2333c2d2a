"""Wire-protocol throughput: encode and decode of one realistic TelemetryBatch.

The batch is a dense GPU node's cycle: 8 GPUs, 16 DIMMs on 2 EDAC controllers, 12 PCIe
functions with every AER counter the kernel exposes, 10 disks, 12 fans and 8 temperatures.

Measured on one core with ``time.perf_counter``: the cases are timed round robin, N times,
and the best run of each is kept:

- msgpack (``proto.codec.encode`` / ``decode`` into the typed union: the wire path)
- JSON (``proto.codec.encode_json`` / ``decode_json`` into the typed union: CLI, HTTP)
- stdlib ``json.dumps`` / ``json.loads`` of the same data as plain builtins (no types,
  no validation): the second baseline

Prints messages per second, bytes per message, and ratios against the JSON codec, the
baseline measured in the same run (the machine is noisy; compare within one run).
Usage: python bench/proto_bench.py [--quick] [--repeats N] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, decode_json, encode, encode_json, to_builtins
from metalguard.proto.telemetry import (
    AerCounters,
    CollectorRun,
    EdacController,
    EdacDimm,
    Fan,
    GpuDevice,
    HwmonChip,
    PcieDevice,
    SmartDevice,
    TelemetryBatch,
    Temperature,
)

AER_CORRECTABLE = [
    *("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr"),
    *("HeaderOF", "TOTAL_ERR_COR"),
]
AER_UNCORRECTABLE = [
    *("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF"),
    *("MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP"),
    *("AtomicOpBlocked", "TLPBlockedErr", "PoisonTLPBlocked"),
]
"""The kernel's short names (drivers/pci/pcie/aer.c) in aer_dev_correctable and
aer_dev_{fatal,nonfatal}; the TOTAL_ERR_* line is added per file below."""

GPUS, DIMMS_PER_MC, MCS, PCIE, DISKS, FANS, TEMPS = 8, 8, 2, 12, 10, 12, 8


def realistic_batch(seq: int = 1000) -> TelemetryBatch:
    """One collection cycle of a dense 8-GPU training node."""
    node = NodeIdentity(
        region="eu-west-1", cluster="gpu-a", node="n0417", uuid="4c4c4544-0035-4a10-8054"
    )
    edac = tuple(
        EdacController(
            mc=mc,
            ce_count=3 * mc,
            ue_count=0,
            ce_noinfo_count=0,
            ue_noinfo_count=0,
            dimms=tuple(
                EdacDimm(
                    name=f"dimm{d}",
                    label=f"CPU_SrcID#{mc}_MC#{mc}_Chan#{d // 2}_DIMM#{d % 2}",
                    ce_count=d % 3,
                    ue_count=0,
                )
                for d in range(DIMMS_PER_MC)
            ),
        )
        for mc in range(MCS)
    )

    def aer(i: int) -> AerCounters:
        fatal = {name: 0 for name in AER_UNCORRECTABLE}
        nonfatal = {name: (i if name == "CmpltTO" else 0) for name in AER_UNCORRECTABLE}
        correctable = {
            name: (i * 7 if name in ("BadTLP", "RxErr") else 0) for name in AER_CORRECTABLE
        }
        correctable["TOTAL_ERR_COR"] = sum(correctable.values())
        fatal["TOTAL_ERR_FATAL"] = 0
        nonfatal["TOTAL_ERR_NONFATAL"] = sum(nonfatal.values())
        return AerCounters(correctable=correctable, fatal=fatal, nonfatal=nonfatal)

    pcie = tuple(
        PcieDevice(
            address=f"0000:{0x17 + 0x10 * i:02x}:00.0",
            pci_class="0x030200" if i < GPUS else "0x020700",
            vendor="0x10de" if i < GPUS else "0x15b3",
            device="0x2330" if i < GPUS else "0x1021",
            current_link_speed_gts=32.0 if i != 5 else 16.0,
            max_link_speed_gts=32.0,
            current_link_width=16,
            max_link_width=16,
            downgraded=i == 5,
            retrains=1 if i == 5 else 0,
            downgrades=1 if i == 5 else 0,
            aer=aer(i),
        )
        for i in range(PCIE)
    )
    smart = tuple(
        SmartDevice(
            device=f"/dev/nvme{i}",
            protocol="NVMe",
            model="SAMSUNG MZWLR3T8HBLS-00007",
            serial=f"S6EUNA0T{i:06d}",
            passed=True,
            exit_status=0,
            temperature_c=36.0 + i,
            power_on_hours=18_234 + i,
            critical_warning=0,
            media_errors=0,
            percentage_used=4,
            available_spare=100,
            num_err_log_entries=12,
            unsafe_shutdowns=7,
        )
        for i in range(DISKS)
    )
    hwmon = (
        HwmonChip(
            chip="platform_nct6775_656",
            name="nct6798",
            fans=tuple(
                Fan(
                    sensor=f"fan{i + 1}",
                    label=f"FAN{i + 1}",
                    rpm=8400.0 + 37 * i,
                    min_rpm=1200.0,
                    alarm=False,
                )
                for i in range(FANS)
            ),
            temps=tuple(
                Temperature(
                    sensor=f"temp{i + 1}",
                    label=f"CPU{i % 2} Die{i // 2}",
                    celsius=54.5 + i,
                    crit_celsius=100.0,
                    max_celsius=95.0,
                )
                for i in range(TEMPS)
            ),
        ),
    )
    gpu = tuple(
        GpuDevice(
            index=i,
            uuid=f"GPU-6d1c8a3e-22f0-4b8f-9c1e-0000000000{i:02d}",
            name="NVIDIA H100 80GB HBM3",
            pci_address=f"0000:{0x17 + 0x10 * i:02x}:00.0",
            temperature_c=61.0 + i,
            power_w=612.5 - i,
            ecc_corrected=i,
            ecc_uncorrected=0,
            retired_pages=0,
            xid_errors=(79,) if i == 3 else (),
        )
        for i in range(GPUS)
    )
    collectors = tuple(
        CollectorRun(collector=name, duration_s=0.004 + 0.001 * k, success=True)
        for k, name in enumerate(("edac", "pcie", "hwmon", "smart", "gpu"))
    )
    return TelemetryBatch(
        node=node,
        seq=seq,
        ts=1_767_225_615.125,
        interval_s=15.0,
        started_ts=1_767_225_614.5,
        edac=edac,
        pcie=pcie,
        hwmon=hwmon,
        smart=smart,
        gpu=gpu,
        collectors=collectors,
    )


@dataclass(frozen=True)
class Result:
    codec: str
    op: str
    msgs_per_s: float
    bytes_per_msg: int


def timed(fn: Callable[[], object], number: int) -> float:
    """Seconds taken by ``number`` calls of ``fn``."""
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return time.perf_counter() - start


def calibrate(fn: Callable[[], object], seconds: float) -> int:
    """How many calls of ``fn`` take about ``seconds``."""
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds / 4 or n >= 1 << 24:
            return max(1, int(n * seconds / max(elapsed, 1e-9)))
        n *= 2


def run(seconds: float, repeats: int) -> list[Result]:
    batch = realistic_batch()
    mp, js = encode(batch), encode_json(batch)
    plain: Any = to_builtins(batch)
    std = json.dumps(plain).encode()
    # Sanity: every path carries the same message before anything is timed.
    assert decode(mp) == batch
    assert decode_json(js) == batch
    assert json.loads(std) == msgspec.json.decode(js)

    cases: list[tuple[str, str, Callable[[], object], int]] = [
        ("msgpack", "encode", lambda: encode(batch), len(mp)),
        ("msgpack", "decode", lambda: decode(mp), len(mp)),
        ("json", "encode", lambda: encode_json(batch), len(js)),
        ("json", "decode", lambda: decode_json(js), len(js)),
        ("stdlib json", "encode", lambda: json.dumps(plain), len(std)),
        ("stdlib json", "decode", lambda: json.loads(std), len(std)),
    ]
    numbers = [calibrate(fn, seconds) for _, _, fn, _ in cases]
    best = [float("inf")] * len(cases)
    # Round robin: every case is sampled across the same stretch of time, so a noisy
    # neighbour slows all of them alike and the ratios stay meaningful.
    for _ in range(repeats):
        for i, (_, _, fn, _) in enumerate(cases):
            best[i] = min(best[i], timed(fn, numbers[i]))
    return [
        Result(codec, op, numbers[i] / best[i], size)
        for i, (codec, op, _, size) in enumerate(cases)
    ]


def table(results: list[Result]) -> str:
    baseline = {r.op: r.msgs_per_s for r in results if r.codec == "json"}
    lines = [
        f"{'codec':<12} {'op':<7} {'msg/s':>11} {'bytes/msg':>10} {'vs json':>8}",
        "-" * 52,
    ]
    for r in results:
        ratio = r.msgs_per_s / baseline[r.op]
        lines.append(
            f"{r.codec:<12} {r.op:<7} {r.msgs_per_s:>11,.0f} {r.bytes_per_msg:>10,d} {ratio:>7.2f}x"
        )
    by = {(r.codec, r.op): r for r in results}
    lines.append("")
    for op in ("encode", "decode"):
        mp, js, std = by["msgpack", op], by["json", op], by["stdlib json", op]
        lines.append(
            f"{op}: msgpack/JSON = {mp.msgs_per_s / js.msgs_per_s:.2f}x, "
            f"msgpack/stdlib json = {mp.msgs_per_s / std.msgs_per_s:.2f}x"
        )
    size = by["msgpack", "encode"].bytes_per_msg / by["json", "encode"].bytes_per_msg
    lines.append(f"size: msgpack/JSON = {size:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny timings")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (best)")
    parser.add_argument("--seconds", type=float, default=None, help="target seconds per timed run")
    args = parser.parse_args(argv)
    seconds = args.seconds or (0.01 if args.quick else 0.15)
    repeats = args.repeats or (2 if args.quick else 12)

    batch = realistic_batch()
    print(
        f"TelemetryBatch: {len(batch.gpu)} GPUs, "
        f"{sum(len(mc.dimms) for mc in batch.edac)} DIMMs, {len(batch.pcie)} PCIe (full AER), "
        f"{len(batch.smart)} disks, {sum(len(c.fans) for c in batch.hwmon)} fans, "
        f"{sum(len(c.temps) for c in batch.hwmon)} temps"
    )
    print(
        f"python {platform.python_version()}, msgspec {msgspec.__version__}, "
        f"{platform.machine()}; best of {repeats} x ~{seconds}s{' (quick)' if args.quick else ''}"
    )
    print()
    started = time.perf_counter()
    print(table(run(seconds, repeats)))
    print(f"\n(total {time.perf_counter() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
