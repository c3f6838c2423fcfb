//! The Markdown report printed on stdout: one table row per figure, the CPU split and
//! Postgres' work during the drain, the targets, the scale-out and sweep tables.

use std::fmt::Write;

use super::{Results, mb, ok};
use crate::amqp::Ceiling;
use crate::sections::{CeilingRuns, Drain, Runner};
use crate::stats::thousands;

impl Results {
    /// The Markdown report printed on stdout.
    pub fn markdown(&self) -> String {
        let s = &self.settings;
        let mut o = String::new();
        let mode = if s.smoke {
            "smoke (tiny sizes: the figures mean nothing)"
        } else {
            "full"
        };
        let _ = writeln!(o, "## outbox-bench: {mode}\n");
        let _ = writeln!(
            o,
            "Machine: {} cores ({}), {:.0} GiB, Linux {}, {}; load average at start {}. \
             Shared and noisy: compare the ratios, not the absolute rates.\n",
            self.machine.cores,
            self.machine.cpu_model,
            self.machine.memory_gib,
            self.machine.kernel,
            self.machine.postgres,
            self.machine.load_at_start
        );
        let _ = writeln!(
            o,
            "Relay: {}. Events: about {} bytes of JSON, {} keys. Run took {:.0} s.\n",
            s.relay.describe(),
            ok(&self.drain).map_or(500.0, |d| d.payload_bytes).round(),
            thousands(s.keys as f64),
            self.duration_s
        );
        let _ = writeln!(o, "| # | measurement | figure | value | ratio |");
        let _ = writeln!(o, "|---|---|---|---|---|");
        let mut row = |n: &str, m: &str, f: &str, v: String, r: String| {
            let _ = writeln!(o, "| {n} | {m} | {f} | {v} | {r} |");
        };
        let ceiling = ok(&self.ceiling).map(CeilingRuns::rate);
        match &self.ceiling {
            Some(Ok(cr)) => {
                let c = cr.first();
                let runs: Vec<String> = cr.runs.iter().map(|c| thousands(c.rate)).collect();
                row(
                    "1",
                    "broker ceiling",
                    &format!(
                        "publish + confirm, no database, {} channels, window {}, {:.0}-byte body, persistent; mean of the runs before and after (2)",
                        c.channels, c.window, c.body_bytes
                    ),
                    format!("{} events/s ({})", thousands(cr.rate()), runs.join(", ")),
                    "1.00".into(),
                )
            }
            Some(Err(e)) => row("1", "broker ceiling", "FAILED", e.clone(), String::new()),
            None => {}
        }
        let of_ceiling = |r: f64| ceiling.map_or(String::new(), |c| format!("{:.2} of (1)", r / c));
        match &self.drain {
            Some(Ok(d)) => {
                row(
                    "2",
                    "backlog drain",
                    &format!(
                        "{} events, {} keys: relay start to all dispatched and queued",
                        thousands(d.events as f64),
                        thousands(s.keys as f64)
                    ),
                    format!("{} events/s ({:.1} s)", thousands(d.rate), d.seconds),
                    of_ceiling(d.rate),
                );
                row(
                    "2",
                    "",
                    "first to last dispatched_at (start-up excluded)",
                    format!("{} events/s", thousands(d.steady_rate)),
                    of_ceiling(d.steady_rate),
                );
                row(
                    "2",
                    "",
                    "relay start to first row dispatched",
                    format!("{:.2} s", d.startup_s),
                    String::new(),
                );
            }
            Some(Err(e)) => row("2", "backlog drain", "FAILED", e.clone(), String::new()),
            None => {}
        }
        match &self.latency {
            Some(Ok(runs)) => {
                for l in runs
                    .iter()
                    .filter(|l| matches!(l.runner, Runner::Relay { .. }))
                {
                    row(
                        "3",
                        &format!(
                            "latency at {}/s, {}",
                            thousands(l.target_rate as f64),
                            if l.listen() {
                                "LISTEN".to_owned()
                            } else {
                                format!("--no-listen (poll {})", l.poll_interval)
                            }
                        ),
                        "commit returned to consumer arrival: p50 / p99 / max",
                        format!(
                            "{:.1} / {:.1} / {:.1} ms",
                            l.summary.p50_ms, l.summary.p99_ms, l.summary.max_ms
                        ),
                        format!(
                            "achieved {}/s, {} samples{}",
                            thousands(l.achieved_rate),
                            thousands(l.summary.count as f64),
                            if l.missing > 0 {
                                format!(", {} not arrived 30 s after the last commit", l.missing)
                            } else {
                                String::new()
                            }
                        ),
                    );
                    let windows: Vec<String> =
                        l.p50_by_5s.iter().map(|x| format!("{x:.0}")).collect();
                    row(
                        "3",
                        "",
                        "p50 per 5 s of the run (ms); Postgres",
                        windows.join(" → "),
                        format!(
                            "{} claims, {:.1} ms and {:.0} pending-index blocks each; {} dead rows at the end, {} autovacuums",
                            thousands(l.pg.claim_calls as f64),
                            l.pg.claim_ms / l.pg.claim_calls.max(1) as f64,
                            l.pg.pending_idx_blks as f64 / l.pg.claim_calls.max(1) as f64,
                            thousands(l.pg.dead_tup as f64),
                            l.pg.autovacuums
                        ),
                    );
                }
            }
            Some(Err(e)) => row("3", "latency", "FAILED", e.clone(), String::new()),
            None => {}
        }
        match &self.producer {
            Some(Ok(p)) => {
                for r in &p.runs {
                    let base = if r.id == "outbox_relay_busy" {
                        format!("{:.2} of plain, relay busy", r.tx_per_s / p.baseline_of(r))
                    } else {
                        format!("{:.2} of plain", r.tx_per_s / p.baseline_of(r))
                    };
                    let notes = match r.notifies {
                        Some(n) => format!(
                            "{} tx/s ({:.2} NOTIFY/tx)",
                            thousands(r.tx_per_s),
                            n as f64 / r.commits.max(1) as f64
                        ),
                        None => format!("{} tx/s", thousands(r.tx_per_s)),
                    };
                    row(
                        "4",
                        &format!("producers ({} connections)", p.producers),
                        &match r.round {
                            Some(n) => format!("{} (pair {n})", r.what),
                            None => r.what.to_owned(),
                        },
                        notes,
                        base,
                    );
                }
                if let Some(median) = p.busy_ratio() {
                    row(
                        "4",
                        "producers, relay busy",
                        "outbox_events against the table without triggers: median of the pairs",
                        p.busy_ratios()
                            .iter()
                            .map(|r| format!("{r:.2}"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        format!("{median:.2}"),
                    );
                }
                row(
                    "4",
                    "idle wake-up",
                    "one event every ~100 ms, commit to arrival: p50 / p99 / max",
                    format!(
                        "{:.1} / {:.1} / {:.1} ms",
                        p.wakeup.p50_ms, p.wakeup.p99_ms, p.wakeup.max_ms
                    ),
                    format!(
                        "{} samples{}",
                        p.wakeup.count,
                        if p.wakeup_missing > 0 {
                            format!(", {} not arrived within 30 s", p.wakeup_missing)
                        } else {
                            String::new()
                        }
                    ),
                );
                if !p.busy_throughout {
                    row(
                        "4",
                        "",
                        "WARNING",
                        "the relay ran out of backlog during the busy runs".into(),
                        String::new(),
                    );
                }
            }
            Some(Err(e)) => row("4", "producer cost", "FAILED", e.clone(), String::new()),
            None => {}
        }
        match &self.growth {
            Some(Ok(g)) => {
                row(
                    "5",
                    "growth",
                    &format!(
                        "drain with {} dispatched rows in the table (made in {:.0} s)",
                        thousands(g.history_rows as f64),
                        g.history_s
                    ),
                    format!(
                        "{} events/s (rounds: {})",
                        thousands(g.loaded_rate()),
                        g.loaded
                            .iter()
                            .map(|d| thousands(d.rate))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    format!(
                        "{:.2} of empty table ({} events/s; rounds: {})",
                        g.ratio(),
                        thousands(g.empty_rate()),
                        g.empty
                            .iter()
                            .map(|d| thousands(d.rate))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
                if let (Some((d, deleted)), Some(r)) = (&g.retained, g.retained_ratio()) {
                    row(
                        "5",
                        "",
                        &format!(
                            "the same with --retention 1h deleting those rows meanwhile ({} deleted by the end of the drain)",
                            thousands(*deleted as f64)
                        ),
                        format!("{} events/s", thousands(d.rate)),
                        format!("{r:.2} of empty table"),
                    );
                }
                row(
                    "5",
                    "",
                    "Postgres, empty table (round 1)",
                    pg_line(&g.empty[0]),
                    String::new(),
                );
                row(
                    "5",
                    "",
                    "Postgres, with the dispatched rows (round 1)",
                    pg_line(&g.loaded[0]),
                    String::new(),
                );
            }
            Some(Err(e)) => row("5", "growth", "FAILED", e.clone(), String::new()),
            None => {}
        }
        if let Some(d) = ok(&self.drain) {
            row(
                "6",
                "relay resources (drain 2)",
                "peak RSS (VmHWM)",
                format!("{:.1} MiB", mb(d.usage.peak_rss_kib)),
                String::new(),
            );
            row(
                "6",
                "",
                "relay CPU per 100,000 events",
                format!("{:.2} s", d.cpu_per_100k(d.cpu.relay)),
                String::new(),
            );
        }
        if let Some(g) = ok(&self.growth) {
            row(
                "6",
                "relay resources (drain 5)",
                "peak RSS / CPU per 100,000 events",
                format!(
                    "{:.1} MiB / {:.2} s",
                    mb(g.loaded[0].usage.peak_rss_kib),
                    g.loaded[0].cpu_per_100k(g.loaded[0].cpu.relay)
                ),
                String::new(),
            );
        }
        o.push('\n');

        if let Some(d) = ok(&self.drain) {
            let _ = writeln!(o, "Where the CPU went during the drain (2):\n");
            o.push_str(&cpu_table(d, ok(&self.ceiling).map(CeilingRuns::first)));
            o.push('\n');
            let _ = writeln!(o, "Postgres during the drain (2): {}.\n", pg_line(d));
        }

        o.push_str(&self.latency_tables());
        let _ = writeln!(o, "Targets:\n");
        let _ = writeln!(o, "| target | goal | measured | met |");
        let _ = writeln!(o, "|---|---|---|---|");
        for t in self.targets() {
            let met = match t.met {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            };
            let _ = writeln!(o, "| {} | {} | {} | {met} |", t.name, t.goal, t.measured);
        }
        o.push('\n');

        if let Some(sc) = ok(&self.scale) {
            let _ = writeln!(
                o,
                "Scale-out: a backlog of {} events drained by several relays started together (each next to a fresh broker ceiling):\n",
                thousands(sc.events as f64)
            );
            let _ = writeln!(
                o,
                "| relays | drain events/s | broker ceiling | ratio to ceiling | ratio to one relay | duplicates |"
            );
            let _ = writeln!(o, "|---|---|---|---|---|---|");
            let one = sc.points.iter().find(|p| p.relays == 1).map(|p| p.ratio());
            for p in &sc.points {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {:.2} | {} | {} |",
                    p.relays,
                    thousands(p.rate),
                    thousands(p.ceiling.rate),
                    p.ratio(),
                    one.map_or("-".into(), |r| format!("{:.2}", p.ratio() / r)),
                    p.duplicates
                );
            }
            o.push('\n');
        }
        if let Some(c) = ok(&self.consumer) {
            let _ = writeln!(
                o,
                "Consumer: a backlog of {} events over {} keys published with the relay's headers, applied by consumer instances started together (tasks of the bench, each with its own pool and connection; prefetch {}, {} partitions), against the relay's drain of {} events in this run ({} events/s):\n",
                thousands(c.events as f64),
                thousands(c.keys as f64),
                c.prefetch,
                c.partitions,
                thousands(c.drain_events as f64),
                thousands(c.drain_rate)
            );
            let _ = writeln!(
                o,
                "| mode | instances | applied events/s | ratio to drain |"
            );
            let _ = writeln!(o, "|---|---|---|---|");
            for p in &c.points {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {:.3} |",
                    p.mode.describe(),
                    p.instances,
                    thousands(p.rate),
                    c.ratio(p)
                );
            }
            o.push('\n');
        }
        if let Some(sw) = ok(&self.sweep) {
            let _ = writeln!(
                o,
                "Sweep: drain rate of {} events / broker ceiling with the same channels measured just before it (ratio), events/s:\n",
                thousands(sw.events as f64)
            );
            let _ = write!(o, "| batch size |");
            for c in &s.sweep_channels {
                let _ = write!(o, " {c} channel{} |", if *c == 1 { "" } else { "s" });
            }
            let _ = write!(o, "\n|---|");
            for _ in &s.sweep_channels {
                let _ = write!(o, "---|");
            }
            o.push('\n');
            for b in &s.sweep_batches {
                let _ = write!(o, "| {b} |");
                for c in &s.sweep_channels {
                    match sw
                        .points
                        .iter()
                        .find(|p| p.batch_size == *b && p.channels == *c)
                    {
                        Some(p) => {
                            let _ = write!(
                                o,
                                " {} / {} ({:.2}) |",
                                thousands(p.drain.rate),
                                thousands(p.ceiling.rate),
                                p.ratio()
                            );
                        }
                        None => o.push_str(" - |"),
                    }
                }
                o.push('\n');
            }
            o.push('\n');
        }
        for (section, e) in self.errors() {
            let _ = writeln!(o, "ERROR in {section}: {e}");
        }
        o
    }
}

/// One line on what Postgres did for a drain.
fn pg_line(d: &Drain) -> String {
    let p = &d.pg;
    let per = |x: f64| x * 100_000.0 / d.events as f64;
    format!(
        "{} claims ({:.0} rows each, {:.1} ms each inside outbox_claim, {:.1} s per 100,000 events); \
         {} transactions; {} row updates ({:.0}% HOT, {:.1} per event); index blocks per 100,000 events: \
         {} read from outside shared_buffers, {} hit; WAL {:.1} KiB per event ({} full-page images per 100,000 events), \
         {} checkpoints started",
        thousands(p.claim_calls as f64),
        d.events as f64 / p.claim_calls.max(1) as f64,
        p.claim_ms / p.claim_calls.max(1) as f64,
        per(p.claim_ms / 1000.0),
        thousands(p.xact_commit as f64),
        thousands(p.tup_upd as f64),
        100.0 * p.tup_hot_upd as f64 / p.tup_upd.max(1) as f64,
        p.tup_upd as f64 / d.events as f64,
        thousands(per(p.idx_blks_read as f64)),
        thousands(per(p.idx_blks_hit as f64)),
        p.wal_bytes as f64 / 1024.0 / d.events as f64,
        thousands(per(p.wal_fpi as f64)),
        p.checkpoints,
    )
}

/// Where the CPU went during the drain, next to the same split while the broker ceiling
/// was measured (per 100,000 messages): what the relay and Postgres add to the broker's work.
fn cpu_table(d: &Drain, ceiling: Option<&Ceiling>) -> String {
    let c = &d.cpu;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let capacity = c.wall_s * cores;
    let per = |v: f64, n: u64| v * 100_000.0 / n.max(1) as f64;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "| process | drain (2): CPU s | per 100,000 events | share of the machine ({:.1} s x {cores} cores) | ceiling (1): CPU s per 100,000 messages |",
        c.wall_s
    );
    let _ = writeln!(o, "|---|---|---|---|---|");
    let cc = ceiling.map(|x| (&x.cpu, x.messages));
    for (name, v, cv) in [
        ("outbox-relay", c.relay, cc.map(|(x, _)| x.relay)),
        (
            "postgres backends of the bench database",
            c.postgres_bench_db,
            cc.map(|(x, _)| x.postgres_bench_db),
        ),
        (
            "postgres background and other databases",
            c.postgres_other,
            cc.map(|(x, _)| x.postgres_other),
        ),
        (
            "rabbitmq (beam.smp)",
            c.rabbitmq,
            cc.map(|(x, _)| x.rabbitmq),
        ),
        (
            "outbox-bench itself (polling; publishing in (1))",
            c.bench,
            cc.map(|(x, _)| x.bench),
        ),
        (
            "everything else (other users of the machine)",
            c.other,
            cc.map(|(x, _)| x.other),
        ),
    ] {
        let ceiling_cell = match (cv, cc) {
            (Some(v), Some((_, n))) => format!("{:.2}", per(v, n)),
            _ => "-".into(),
        };
        let _ = writeln!(
            o,
            "| {name} | {v:.2} | {:.2} | {:.0}% | {ceiling_cell} |",
            d.cpu_per_100k(v),
            100.0 * v / capacity.max(1e-9)
        );
    }
    let _ = writeln!(
        o,
        "| machine busy | | | {:.0}% | {} |",
        100.0 * c.machine_busy_frac,
        cc.map_or("-".into(), |(x, _)| format!(
            "{:.0}% busy",
            100.0 * x.machine_busy_frac
        ))
    );
    o
}
