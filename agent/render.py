"""A TelemetryBatch as text for a person at a terminal (``--format text``)."""

from __future__ import annotations

from metalguard.proto.telemetry import DatasetCache, RdmaPort, TelemetryBatch

RDMA_ERROR_COUNTERS = ("link_downed", "link_error_recovery", "symbol_error", "port_rcv_errors")
"""The error counters an ``rdma`` line shows (``-``: the port has no such counter)."""


def _n(value: object) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def render_text(batch: TelemetryBatch) -> str:
    """A few aligned lines per source; errors last."""
    node = batch.node
    lines = [
        f"node {node.region}/{node.cluster}/{node.node} uuid={node.uuid or '-'} seq={batch.seq}"
    ]
    for mc in batch.edac:
        lines.append(
            f"edac  mc{mc.mc}: ce={_n(mc.ce_count)} ue={_n(mc.ue_count)} "
            f"ce_noinfo={_n(mc.ce_noinfo_count)} ue_noinfo={_n(mc.ue_noinfo_count)}"
        )
        for dimm in mc.dimms:
            lines.append(
                f"        {dimm.name} {dimm.label}: ce={_n(dimm.ce_count)} ue={_n(dimm.ue_count)}"
            )
        for row in mc.csrows:
            lines.append(f"        csrow{row.csrow}: ce={_n(row.ce_count)} ue={_n(row.ue_count)}")
    for dev in batch.pcie:
        flag = "  DOWNGRADED" if dev.downgraded else ""
        aer = ""
        if dev.aer is not None:
            aer = (
                f" aer cor={dev.aer.correctable.get('TOTAL_ERR_COR', '-')}"
                f" fatal={dev.aer.fatal.get('TOTAL_ERR_FATAL', '-')}"
                f" nonfatal={dev.aer.nonfatal.get('TOTAL_ERR_NONFATAL', '-')}"
            )
        lines.append(
            f"pcie  {dev.address} class={dev.pci_class} {dev.vendor}:{dev.device} "
            f"link {_n(dev.current_link_speed_gts)}/{_n(dev.max_link_speed_gts)} GT/s "
            f"x{_n(dev.current_link_width)}/x{_n(dev.max_link_width)}{aer}{flag}"
        )
    for chip in batch.hwmon:
        for fan in chip.fans:
            alarm = "  ALARM" if fan.alarm else ""
            lines.append(
                f"fan   {chip.chip} {fan.sensor} {fan.label}: {_n(fan.rpm)} rpm "
                f"(min {_n(fan.min_rpm)}){alarm}"
            )
        for temp in chip.temps:
            lines.append(
                f"temp  {chip.chip} {temp.sensor} {temp.label}: {_n(temp.celsius)} C "
                f"(max {_n(temp.max_celsius)}, crit {_n(temp.crit_celsius)})"
            )
    for disk in batch.smart:
        verdict = {True: "PASSED", False: "FAILED", None: "unknown"}[disk.passed]
        lines.append(
            f"smart {disk.device} {disk.protocol} {disk.model}: {verdict} "
            f"temp={_n(disk.temperature_c)} hours={_n(disk.power_on_hours)}"
        )
    for bmc in batch.bmc:
        state = "reachable" if bmc.reachable else "UNREACHABLE"
        lines.append(
            f"bmc   {bmc.node or '-'} {bmc.source}: {state} power={bmc.power_state or '-'} "
            f"health={bmc.health or '-'}" + (f" ({bmc.message})" if bmc.message else "")
        )
        for s in bmc.sensors:
            unit = f" {s.unit}" if s.unit else ""
            lines.append(
                f"        {s.kind} {s.name}: {_n(s.value)}{unit} {s.status or '-'} "
                f"(crit {_n(s.lower_critical)}..{_n(s.upper_critical)})"
            )
    lines.extend(_rdma_line(port) for port in batch.rdma)
    lines.extend(_cache_line(cache) for cache in batch.cache)
    if (posture := batch.iommu) is not None:
        lines.append(
            f"iommu {posture.posture} mode={posture.mode or '-'} "
            f"units={','.join(posture.iommus) or '-'} groups={posture.groups} "
            f"devices={len(posture.devices)}"
        )
        lines.extend(f"        {reason}" for reason in posture.reasons)
    for run in batch.collectors:
        ok = "ok" if run.success else "FAILED"
        lines.append(f"run   {run.collector}: {ok} in {run.duration_s * 1000:.1f} ms")
    for err in batch.errors:
        where = f" {err.path}" if err.path else ""
        lines.append(f"error {err.collector}{where}: {err.message}")
    return "\n".join(lines) + "\n"


def _rdma_line(port: RdmaPort) -> str:
    """One RDMA port: state, physical state, rate, link layer, netdev, error counters."""
    rate = "-" if port.rate_gbps is None else f"{port.rate_gbps:g} Gb/s"
    counters = " ".join(f"{c}={_n(port.counters.get(c))}" for c in RDMA_ERROR_COUNTERS)
    flag = f"  SATURATED {','.join(port.saturated)}" if port.saturated else ""
    return (
        f"rdma  {port.device}/{port.port} {port.state or '-'} {port.phys_state or '-'} "
        f"{rate} {port.link_layer or '-'} netdev={port.netdev or '-'} {counters}{flag}"
    )


def _cache_line(cache: DatasetCache) -> str:
    """One dataset cache: occupancy, hit ratio, bytes from cache and source, policy."""
    if cache.ts <= 0:
        return f"cache {cache.dataset}: not running (max {cache.max_bytes} B) {cache.cache_dir}"
    reads = cache.hits + cache.misses
    ratio = f"{cache.hits / reads:.0%}" if reads else "-"
    pattern = f"/{cache.pattern}" if cache.pattern else ""
    return (
        f"cache {cache.dataset}: {cache.used_bytes}/{cache.max_bytes} B in "
        f"{cache.cached_files} files, hits {cache.hits} misses {cache.misses} ({ratio}), "
        f"from cache {cache.bytes_from_cache} B, from source {cache.bytes_from_source} B, "
        f"evictions {cache.evictions}, policy {cache.policy or '-'}{pattern}, "
        f"warnings {cache.warnings} mount={cache.mountpoint or '-'}"
    )
