"""The readable form of a plan: ``flatshard plan`` without ``--json``.

By default a summary within WIDTH (100) columns: one table of every plan (memory, communication, step)
and, with ``--offload``, one of the same with CPU offload; ``--full`` prints the full tables instead
(every byte and collective count, serial and overlapped times: up to 140 columns). Tables are built as
plain data (title, column titles, rows of strings) and printed with rich when it is installed
(``pip install flatshard[cli]``), as aligned plain text otherwise: the figures are the same either way.
Column titles say what each column holds: a count of collective calls, or GB (10^9 bytes,
[Note: planner units]). After the tables, the schedule the step assumes, the recommendation and notes.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass, field

from flatshard.planner.inputs import OPTIMIZERS
from flatshard.planner.memory import activations_missing
from flatshard.planner.plan import PlanReport, notes, recommend_offload
from flatshard.planner.quantities import fmt_bytes, fmt_count, fmt_seconds
from flatshard.planner.steptime import schedule_label

VERDICTS = {"yes": "green", "no": "red"}
WIDTH = 100  # the summary's columns; the full tables take up to FULL_WIDTH
FULL_WIDTH = 140


@dataclass
class Table:
    title: str
    columns: tuple[str, ...]  # the first column (the strategy) is left-aligned, the others right-aligned
    rows: list[tuple[str, ...]] = field(default_factory=list)

    def add(self, *cells: str) -> None:
        self.rows.append(tuple(cells))


def _gb(n: float) -> str:
    return f"{n / 1e9:.4g}"


def _verdict(fits: bool | None) -> str:
    return "yes" if fits else ("?" if fits is None else "no")


def memory_table(report: PlanReport) -> Table:
    counted = not activations_missing(report.inputs)
    ragged = report.inputs.boundaries_modelled != "flat"  # shards differ: the smallest rank's steady too
    title = "memory per rank, GB (10^9 bytes)"
    if ragged:
        title += (
            f' (shard_boundaries="{report.inputs.boundaries_modelled}": the largest rank; steady min: the smallest)'
        )
    if any(p.optimizer_across_replicas for p in report.plans):
        title += "; +OptR: shard_optimizer_across_replicas=True (gradients and optimizer state over all W ranks)"
    columns = ("strategy", "F", "R", "steady", *(("steady min",) if ragged else ()), "gathered", "unsh. grad")
    table = Table(title, (*columns, "activations", "fwd peak", "peak", "fits"))
    for p in report.plans:
        b = p.memory
        acts = _gb(b.activations) if counted else "not counted"
        table.add(
            p.label,
            str(p.sharding_factor),
            str(p.replicas),
            _gb(b.steady),
            *((_gb(min(b.steady_per_rank, default=b.steady)),) if ragged else ()),
            _gb(b.gather_buffer),
            _gb(b.unsharded_grad),
            acts,
            _gb(b.forward_peak),
            _gb(b.peak),
            _verdict(p.fits),
        )
    return table


def summary_table(report: PlanReport) -> Table:
    """Every plan in one table within WIDTH columns: memory per rank, bytes moved, the expected step."""
    counted = not activations_missing(report.inputs)
    ragged = report.inputs.boundaries_modelled != "flat"
    table = Table(
        "memory per rank, GB (10^9 bytes): steady (between steps"
        + ("; steady min: the smallest rank's" if ragged else "")
        + "), activations, peak; comm GB: moved per rank per step; step: seconds, on the schedule below",
        (
            "strategy",
            "F",
            "steady",
            *(("steady min",) if ragged else ()),
            "activations",
            "peak",
            "fits",
            "comm GB",
            "step",
        ),
    )
    for p in report.plans:
        b = p.memory
        table.add(
            p.label,
            str(p.sharding_factor),
            _gb(b.steady),
            *((_gb(min(b.steady_per_rank, default=b.steady)),) if ragged else ()),
            _gb(b.activations) if counted else "not counted",
            _gb(b.peak),
            _verdict(p.fits),
            _gb(p.comm.total),
            fmt_seconds(p.time.expected_s),
        )
    return table


def offload_summary_table(report: PlanReport) -> Table:
    """The plans with CPU offload within WIDTH columns: device peak, host per node, the step."""
    i = report.inputs
    host = "unknown" if i.host_memory_bytes is None else f"<= {fmt_bytes(i.host_budget_bytes or 0)}"
    table = Table(
        f"with CPU offload, GB (10^9 bytes): device peak per rank; host per node of {i.ranks_per_node} "
        f"(fits: {host}); step with the copies and the CPU optimizer",
        ("strategy", "F", "device peak", "host/node", "fits", "step"),
    )
    for p in report.plans:
        o = p.offload
        if o is not None:  # None: a "+OptR" plan, not built with CPU offload
            table.add(
                p.strategy.value,
                str(p.sharding_factor),
                _gb(o.device_peak),
                _gb(o.host_per_node),
                _verdict(o.fits),
                fmt_seconds(o.step_time_s),
            )
    return table


def comm_table(report: PlanReport) -> Table:
    table = Table(
        "communication per rank per step: calls of all-gather (AG, forward/backward), reduce-scatter (RS) and "
        "all-reduce (AR); GB (10^9 bytes) within and between nodes, and what a node sends to other nodes (node GB); "
        f"seconds per step serial, overlapped and expected ({schedule_label(report.inputs).split(':')[0]}: "
        "see step below; JSON step_time_s)",
        (
            "strategy",
            "F",
            "AG calls f/b",
            "RS calls",
            "AR calls",
            "intra GB",
            "inter GB",
            "total GB",
            "node GB",
            "serial",
            "overlapped",
            "expected",
        ),
    )
    if any(p.optimizer_across_replicas for p in report.plans):
        table.title += (
            "; +OptR: the replicate group's reduce-scatter counts as RS, its all-gather of the pieces as AG forward"
        )
    for p in report.plans:
        c, t, n = p.comm, p.time, p.comm.counts
        table.add(
            p.label,
            str(p.sharding_factor),
            f"{n.all_gather_forward}/{n.all_gather_backward}",
            str(n.reduce_scatter_backward),
            str(n.all_reduce_backward),
            _gb(c.intra_node),
            _gb(c.inter_node),
            _gb(c.total),
            _gb(c.node_link),
            fmt_seconds(t.serial_s),
            fmt_seconds(t.overlapped_s),
            fmt_seconds(t.expected_s),
        )
    return table


def offload_table(report: PlanReport) -> Table:
    i = report.inputs
    host = "unknown" if i.host_memory_bytes is None else f"<= {fmt_bytes(i.host_budget_bytes or 0)}"
    table = Table(
        f"with CPU offload, GB (10^9 bytes): device peak per rank; host per rank and per node of "
        f"{i.ranks_per_node} (fits: {host}); copies per rank per step at {fmt_bytes(i.pcie_bandwidth)}/s; "
        f"CPU optimizer at {fmt_bytes(i.host_bandwidth)}/s per node",
        (
            "strategy",
            "F",
            "device peak",
            "device fits",
            "host/rank",
            "host/node",
            "host fits",
            "fits",
            "H2D GB",
            "D2H GB",
            "copy time",
            "optim. time",
            "step",
        ),
    )
    for p in report.plans:
        o = p.offload
        if o is None:  # a "+OptR" plan: not built with CPU offload
            continue
        table.add(
            p.strategy.value,
            str(p.sharding_factor),
            _gb(o.device_peak),
            _verdict(o.device_fits),
            _gb(o.host_per_rank),
            _gb(o.host_per_node),
            _verdict(o.host_fits),
            _verdict(o.fits),
            _gb(o.host_to_device),
            _gb(o.device_to_host),
            fmt_seconds(o.copy_s),
            fmt_seconds(o.optimizer_s),
            fmt_seconds(o.step_time_s),
        )
    return table


def header(report: PlanReport) -> str:
    i, rec = report.inputs, report.inputs.recipe
    m = len(i.unit_elements) + (1 if i.root_elements else 0)
    opt = OPTIMIZERS[i.optimizer][0]
    return (
        f"{fmt_count(i.params)} parameters in {m} unit{'s' if m != 1 else ''} (root {fmt_count(i.root_elements)}), "
        f"W={i.world_size}, {i.gpus_per_node} GPUs/node, {rec.name}, {i.optimizer}, shard_boundaries="
        f"{i.boundaries_modelled}. Steady = "
        f"{rec.master_bytes}+{rec.grad_shard_bytes}+{opt} bytes per shard element (params+grads+"
        f"optimizer). Fits: peak <= {fmt_bytes(i.budget_bytes)} ({fmt_bytes(i.device_memory_bytes)} "
        f"less {i.headroom:.0%}){'; activations not counted' if activations_missing(i) else ''}."
    )


def closing(report: PlanReport) -> list[tuple[str, str]]:
    """(label, text) lines after the tables: the recommendation, with CPU offload, and the notes."""
    i, r = report.inputs, report.recommendation
    head = f"{r.strategy.value}, F={r.sharding_factor}" if r.strategy else "none"
    out = [("recommendation", f"{head}. {r.why}")]
    if i.offload and r.strategy is not None:  # when nothing fits, ``why`` already has the offload verdict
        o = recommend_offload(i, report.plans)
        head = f"{o.strategy.value}, F={o.sharding_factor}" if o.strategy else "none"
        out.append(("with CPU offload", f"{head}. {o.why}"))
    out += [("note", n) for n in notes(i)]
    return out


def step_line(report: PlanReport, full: bool) -> tuple[str, str]:
    """("step", the schedule the expected step assumes), said where the tables end."""
    more = "" if full or report.inputs.prefetch_depth >= 1 else " (--full prints it)"
    return ("step", schedule_label(report.inputs) + more)


def print_report(report: PlanReport, full: bool = False) -> None:
    """The summary (``full`` False, within WIDTH columns) or the full tables, then the closing lines."""
    offload = report.inputs.offload
    if full:
        tables = [memory_table(report), comm_table(report)] + ([offload_table(report)] if offload else [])
    else:
        tables = [summary_table(report)] + ([offload_summary_table(report)] if offload else [])
    lines = [step_line(report, full), *closing(report)]
    try:
        import rich  # noqa: F401  (optional: pip install flatshard[cli])
    except ImportError:
        _print_plain(header(report), tables, lines)
    else:
        _print_rich(header(report), tables, lines, FULL_WIDTH if full else WIDTH)


def _print_rich(head: str, tables: list[Table], lines: list[tuple[str, str]], width: int) -> None:
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.measure import Measurement
    from rich.table import Table as RichTable

    tty = sys.stdout.isatty()
    console = Console() if tty else Console(width=width)  # logs: a fixed width
    console.print(head, markup=False, highlight=False)
    for t in tables:
        out = RichTable(title=t.title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
        for k, col in enumerate(t.columns):
            if k == 0:
                out.add_column(col, no_wrap=True, min_width=19)
            else:
                out.add_column(col, justify="right")
        for row in t.rows:
            out.add_row(*(f"[{VERDICTS[c]}]{c}[/]" if c in VERDICTS else escape(c) for c in row))
        need = Measurement.get(console, console.options.update_width(10_000), out).maximum
        # in a log a full table keeps its columns whole, however wide ("+OptR" names widen them)
        (console if tty or need <= console.width else Console(width=need)).print(out)
    for label, text in lines:
        console.print(f"[bold]{label}:[/] {escape(text)}")


def _wrap(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_on_hyphens=False)


def _print_plain(head: str, tables: list[Table], lines: list[tuple[str, str]]) -> None:
    """Aligned text; the prose wrapped to WIDTH columns (a full table may be wider)."""
    print(_wrap(head))
    for t in tables:
        widths = [max([len(c)] + [len(r[k]) for r in t.rows]) for k, c in enumerate(t.columns)]

        def line(cells: tuple[str, ...], widths: list[int] = widths) -> str:
            return "  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))

        print()
        print(_wrap(t.title))
        print(line(t.columns))
        print("-" * len(line(t.columns)))
        for row in t.rows:
            print(line(row))
    print()
    for label, text in lines:
        print(_wrap(f"{label}: {text}"))
