"""scripts/cpu-profile.py's sorting of perf samples into categories, on stacks written as
``perf script -F comm,tid,ip,sym,dso`` prints them (perf itself is not run here: the
script's figures in BENCHMARKING come from runs on the CI VM)."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cpu_profile", ROOT / "scripts" / "cpu-profile.py")
assert spec is not None and spec.loader is not None
cpu_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_profile)

K = "([kernel.kallsyms])"
BIN = "(/work/target/release/kvxfer-bench)"
LIBC = "(/usr/lib/x86_64-linux-gnu/libc.so.6)"


def stack(*frames: str) -> str:
    """One sample: a header line, then its frames leaf first."""
    return "kvxfer-bench-de 4242\n" + "".join(f"\t    ffff{i:04x} {f}\n" for i, f in enumerate(frames)) + "\n"


def categories(text: str) -> list[str]:
    return [cpu_profile.category(s) for s in cpu_profile.parse_samples(text)]


def test_each_sample_lands_in_the_first_category_that_matches():
    text = "".join(
        [
            # CRC inside kvxfer: crc32c, wherever it sits.
            stack(f"crc_fast::crc32::fusion::x86::crc32_iscsi+0x10 {BIN}", f"kvxfer_tcp::read::serve_read {BIN}"),
            # The kernel copying a payload into the decode's buffer.
            stack(f"_copy_to_iter+0x5 {K}", f"tcp_recvmsg_locked {K}", f"kvxfer_tcp::client::Connection::read {BIN}"),
            # malloc called by kvxfer.
            stack(f"_int_malloc+0x20 {LIBC}", f"kvxfer_core::plan::ResultPlan::build {BIN}"),
            # A thread going to sleep in epoll under tokio.
            stack(f"finish_task_switch.isra.0 {K}", f"__schedule {K}", f"do_epoll_wait {K}", f"tokio::runtime::io::driver::Driver::turn {BIN}"),
            # The TCP stack.
            stack(f"tcp_ack+0x1 {K}", f"tcp_rcv_established {K}", f"kvxfer::decode::pull::Pull::run {BIN}"),
            # The bench parsing its lease answers, kernel work on its behalf included.
            stack(f"hex::decode {BIN}", f"kvxfer_bench::source::result_from_hex {BIN}"),
            stack(f"tcp_recvmsg {K}", f"kvxfer_bench::source::RemoteSource::answer {BIN}"),
            # The bench's byte-pattern check is the bench's, not kvxfer_mem's.
            stack(f"kvxfer_mem::pattern::check_blocks {BIN}", f"kvxfer_bench::measure::run_block_size {BIN}"),
            # kvxfer's own code under a bench thread that drives the runtime: not the bench's.
            stack(f"kvxfer_core::pull::PullMachine::progress {BIN}", f"kvxfer_bench::workload::next_until {BIN}"),
            stack(f"tokio::runtime::scheduler::current_thread::CoreGuard::block_on {BIN}", f"kvxfer_bench::workload::next_until {BIN}"),
            # An engine's thread (the bench's) asleep waiting for a pull: scheduling, not the bench.
            stack(f"finish_task_switch.isra.0 {K}", f"__schedule {K}", f"futex_wait {K}", f"syscall {LIBC}",
                  f"std::thread::park {BIN}", f"kvxfer_bench::workload::next_until {BIN}"),
        ]
    )
    assert categories(text) == [
        "crc32c",
        "payload_copy",
        "allocator",
        "scheduling",
        "kernel_other",
        "harness",
        "harness",
        "harness",
        "user_other",
        "user_other",
        "scheduling",
    ]


def test_a_user_space_mutex_named_futex_is_not_scheduling():
    # std's futex-based mutex fast path never enters the kernel.
    text = stack(f"std::sys::sync::mutex::futex::Mutex::lock {BIN}", f"kvxfer::decode::DecodeAgent::submit {BIN}")
    assert categories(text) == ["user_other"]
