//! What the kernel says about processes and the machine: CPU time (`/proc/<pid>/stat`,
//! `/proc/stat`) and peak resident memory (`/proc/<pid>/status` VmHWM).
//!
//! CPU is attributed by comparing two snapshots of every process: the relay (by pid), the
//! Postgres backends that served the bench's database (by pid, from `pg_stat_activity`),
//! the rest of Postgres (background writers, other databases), RabbitMQ (`beam.smp`), the
//! bench itself, and "other" (the machine's busy time less all of those: other engineers'
//! compilers and tests on this shared machine). A process that starts and ends between two
//! snapshots is only visible in the machine total, so it lands in "other".

use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// Linux reports process CPU time in USER_HZ ticks, which the userspace ABI fixes at 100
/// on x86_64 and arm64 whatever the kernel's internal HZ (see `man 5 proc`).
const TICKS_PER_SEC: f64 = 100.0;

/// One process's accounting fields from `/proc/<pid>/stat`.
#[derive(Clone, Debug)]
pub struct ProcStat {
    pub comm: String,
    /// utime + stime, seconds.
    pub cpu: f64,
    /// Distinguishes a reused pid.
    pub start_ticks: u64,
}

pub fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// Parses `pid (comm) state ppid ...`; comm may hold spaces and parentheses, so fields are
/// counted from the last ')'.
fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_owned();
    let rest: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    // rest[0] is field 3 (state); utime is field 14, stime 15, starttime 22.
    let field = |n: usize| rest.get(n - 3).and_then(|s| s.parse::<u64>().ok());
    let utime = field(14)?;
    let stime = field(15)?;
    let start_ticks = field(22)?;
    Some(ProcStat {
        comm,
        cpu: (utime + stime) as f64 / TICKS_PER_SEC,
        start_ticks,
    })
}

/// Peak resident set size (VmHWM) in KiB.
pub fn vm_hwm_kib(pid: u32) -> Option<u64> {
    status_field(pid, "VmHWM:")
}

/// Current resident set size (VmRSS) in KiB.
pub fn vm_rss_kib(pid: u32) -> Option<u64> {
    status_field(pid, "VmRSS:")
}

fn status_field(pid: u32, name: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Busy and total CPU seconds of the whole machine (all cores) from `/proc/stat`.
fn machine_cpu() -> (f64, f64) {
    let Ok(text) = std::fs::read_to_string("/proc/stat") else {
        return (0.0, 0.0);
    };
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0.0, 0.0);
    };
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|s| s.parse().ok())
        .collect();
    let get = |i: usize| v.get(i).copied().unwrap_or(0.0);
    // user nice system idle iowait irq softirq steal
    let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
    let total = busy + get(3) + get(4);
    (busy / TICKS_PER_SEC, total / TICKS_PER_SEC)
}

/// Every process's CPU seconds at one moment, and the machine's.
pub struct Snapshot {
    at: Instant,
    procs: HashMap<u32, ProcStat>,
    machine_busy: f64,
    machine_total: f64,
}

impl Snapshot {
    /// When it was taken.
    pub fn at(&self) -> Instant {
        self.at
    }

    pub fn take() -> Snapshot {
        let mut procs = HashMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                    continue;
                };
                if let Some(stat) = proc_stat(pid) {
                    procs.insert(pid, stat);
                }
            }
        }
        let (machine_busy, machine_total) = machine_cpu();
        Snapshot {
            at: Instant::now(),
            procs,
            machine_busy,
            machine_total,
        }
    }
}

/// CPU seconds the processes `pids` spent from `a` to `b` (one that started in between
/// counts from its start).
pub fn cpu_of(a: &Snapshot, b: &Snapshot, pids: &HashSet<u32>) -> f64 {
    pids.iter()
        .filter_map(|pid| {
            let now = b.procs.get(pid)?;
            let before = a
                .procs
                .get(pid)
                .filter(|p| p.start_ticks == now.start_ticks)
                .map_or(0.0, |p| p.cpu);
            Some((now.cpu - before).max(0.0))
        })
        .fold(0.0, |sum, x| sum + x) // not sum(): an empty f64 sum is -0.0
}

/// CPU seconds spent between two snapshots, by who spent them.
#[derive(Clone, Debug, Default)]
pub struct CpuSplit {
    pub wall_s: f64,
    pub relay: f64,
    /// Backends connected to the bench's database (the relay's pool and LISTEN, producers).
    pub postgres_bench_db: f64,
    /// Postgres background processes and backends of other databases.
    pub postgres_other: f64,
    pub rabbitmq: f64,
    pub bench: f64,
    pub other: f64,
    /// The machine's busy time over its capacity (cores × wall), 0..1.
    pub machine_busy_frac: f64,
}

impl CpuSplit {
    /// Attributes the CPU spent from `a` to `b`. `relay` is the relay's pid, `bench_backends`
    /// the Postgres backend pids that served the bench's database.
    pub fn between(
        a: &Snapshot,
        b: &Snapshot,
        relay: Option<u32>,
        bench_backends: &HashSet<u32>,
    ) -> CpuSplit {
        let me = std::process::id();
        let mut split = CpuSplit {
            wall_s: b.at.duration_since(a.at).as_secs_f64(),
            ..CpuSplit::default()
        };
        let mut attributed = 0.0;
        for (pid, now) in &b.procs {
            let before = a
                .procs
                .get(pid)
                .filter(|p| p.start_ticks == now.start_ticks)
                .map_or(0.0, |p| p.cpu);
            let spent = (now.cpu - before).max(0.0);
            if spent == 0.0 {
                continue;
            }
            let slot = if Some(*pid) == relay {
                &mut split.relay
            } else if *pid == me {
                &mut split.bench
            } else if now.comm == "postgres" && bench_backends.contains(pid) {
                &mut split.postgres_bench_db
            } else if now.comm == "postgres" {
                &mut split.postgres_other
            } else if now.comm == "beam.smp" {
                &mut split.rabbitmq
            } else {
                continue;
            };
            *slot += spent;
            attributed += spent;
        }
        let busy = (b.machine_busy - a.machine_busy).max(0.0);
        let total = (b.machine_total - a.machine_total).max(0.0);
        split.other = (busy - attributed).max(0.0);
        split.machine_busy_frac = if total > 0.0 { busy / total } else { 0.0 };
        split
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let line = "4242 (tokio (rt) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 150 50 7 3 20 0 4 0 98765 1000000 200 18446744073709551615";
        let s = parse_stat(line).unwrap();
        assert_eq!(s.comm, "tokio (rt) x");
        assert!((s.cpu - 2.0).abs() < 1e-9, "{}", s.cpu);
        assert_eq!(s.start_ticks, 98765);
    }

    #[test]
    fn this_process_is_visible() {
        let me = proc_stat(std::process::id()).unwrap();
        assert!(me.cpu >= 0.0);
        assert!(vm_hwm_kib(std::process::id()).unwrap() > 0);
    }
}
