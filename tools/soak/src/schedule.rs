//! The fault schedule: which fault, on what, when and for how long, drawn from the seed
//! alone, so a seed reproduces its schedule exactly (the timing of everything else does
//! not repeat to the millisecond, the schedule does).
//!
//! The first faults are one of each kind in a seeded order, so even a short run injects
//! every kind; after that kinds are drawn at random. Faults overlap in time, but never two
//! on the same process at once (a relay being killed is not also paused), and every fault
//! ends before the run's duration does: the quiet period starts with a healed system.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::rng::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Relay(usize),
    Consumer(usize),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Relay(i) => write!(f, "relay {i}"),
            Target::Consumer(i) => write!(f, "consumer {i}"),
        }
    }
}

/// Which connection of a process a proxy fault hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Service {
    Postgres,
    Rabbitmq,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// SIGKILL, down for `down_ms`, then a new process in the same slot.
    KillRelay { relay: usize, down_ms: u64 },
    /// SIGSTOP for `pause_ms` (longer than the takeover time), then SIGCONT.
    PauseRelay { relay: usize, pause_ms: u64 },
    /// `rabbitmqctl close_connection` on the process's AMQP connection.
    CloseAmqp { target: Target },
    /// The process's proxy forwards nothing for `hold_ms`.
    Blackhole {
        target: Target,
        service: Service,
        hold_ms: u64,
    },
    /// The process's proxy delays every chunk by `delay_ms` for `hold_ms`.
    Delay {
        target: Target,
        service: Service,
        delay_ms: u64,
        hold_ms: u64,
    },
    /// The process's proxy resets its connections (and new ones) for `hold_ms`.
    Reset {
        target: Target,
        service: Service,
        hold_ms: u64,
    },
    /// `pg_terminate_backend` on every session of the process.
    TerminatePg { target: Target },
    /// The consumer's next send is accepted by the destination, then the consumer is
    /// SIGKILLed before it can commit, and started again.
    CrashConsumer { consumer: usize },
    /// Copies of `count` already dispatched events published straight to the exchange.
    Duplicates { count: usize },
}

impl Fault {
    pub fn target(&self) -> Option<Target> {
        match self {
            Fault::KillRelay { relay, .. } | Fault::PauseRelay { relay, .. } => {
                Some(Target::Relay(*relay))
            }
            Fault::CloseAmqp { target }
            | Fault::Blackhole { target, .. }
            | Fault::Delay { target, .. }
            | Fault::Reset { target, .. }
            | Fault::TerminatePg { target } => Some(*target),
            Fault::CrashConsumer { consumer } => Some(Target::Consumer(*consumer)),
            Fault::Duplicates { .. } => None,
        }
    }

    /// How long the fault lasts as planned (instant ones: a rough allowance for the
    /// command that injects them).
    pub fn length(&self) -> Duration {
        Duration::from_millis(match self {
            Fault::KillRelay { down_ms, .. } => *down_ms,
            Fault::PauseRelay { pause_ms, .. } => *pause_ms,
            Fault::Blackhole { hold_ms, .. }
            | Fault::Delay { hold_ms, .. }
            | Fault::Reset { hold_ms, .. } => *hold_ms,
            Fault::CloseAmqp { .. } => 3_000,
            Fault::CrashConsumer { .. } => 3_000,
            Fault::TerminatePg { .. } | Fault::Duplicates { .. } => 500,
        })
    }

    /// Whether the fault can make a relay publish a row again (a duplicate the relay
    /// itself causes): it loses a relay's acks, marks or lease.
    pub fn hits_a_relay(&self) -> bool {
        matches!(self.target(), Some(Target::Relay(_)))
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |ms: &u64| format!("{:.1}s", *ms as f64 / 1000.0);
        match self {
            Fault::KillRelay { relay, down_ms } => {
                write!(f, "SIGKILL relay {relay}, restart after {}", s(down_ms))
            }
            Fault::PauseRelay { relay, pause_ms } => {
                write!(f, "SIGSTOP relay {relay} for {}, then SIGCONT", s(pause_ms))
            }
            Fault::CloseAmqp { target } => {
                write!(f, "rabbitmqctl close_connection of {target}")
            }
            Fault::Blackhole {
                target,
                service,
                hold_ms,
            } => write!(f, "blackhole {target}'s {service:?} for {}", s(hold_ms)),
            Fault::Delay {
                target,
                service,
                delay_ms,
                hold_ms,
            } => write!(
                f,
                "delay {target}'s {service:?} by {delay_ms}ms for {}",
                s(hold_ms)
            ),
            Fault::Reset {
                target,
                service,
                hold_ms,
            } => write!(f, "reset {target}'s {service:?} for {}", s(hold_ms)),
            Fault::TerminatePg { target } => write!(f, "pg_terminate_backend of {target}"),
            Fault::CrashConsumer { consumer } => write!(
                f,
                "SIGKILL consumer {consumer} after its send was accepted, before its commit; restart"
            ),
            Fault::Duplicates { count } => {
                write!(f, "publish copies of {count} dispatched events")
            }
        }
    }
}

/// One fault and when it starts, from the start of the run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Planned {
    pub at_ms: u64,
    #[serde(flatten)]
    pub fault: Fault,
}

/// What the schedule is drawn for.
#[derive(Clone, Debug)]
pub struct Shape {
    pub duration: Duration,
    pub relays: usize,
    pub consumers: usize,
    /// The relays' `--lease`: a pause must outlast the takeover time (lease + lease/3).
    pub lease: Duration,
}

const KINDS: usize = 10;

/// Seconds before the first fault: relays and consumers are up and the stream flows.
const WARMUP_MS: u64 = 5_000;
/// Every fault ends this long before the duration does.
const TAIL_MS: u64 = 1_500;

pub fn draw(seed: u64, shape: &Shape) -> Vec<Planned> {
    let mut rng = Rng::new(seed).fork(1);
    let end = shape.duration.as_millis() as u64;
    let lease = shape.lease.as_millis() as u64;
    let mut busy_until: std::collections::HashMap<Target, u64> = Default::default();
    let mut first: Vec<usize> = (0..KINDS).collect();
    rng.shuffle(&mut first);
    let mut next_kind = first.into_iter();
    let mut plan = Vec::new();
    let mut at = WARMUP_MS;
    // A kind that did not fit where it was drawn is tried again at the next slot, so the
    // first round still brings every kind.
    let mut pending: Option<usize> = None;
    while at + TAIL_MS + 500 < end {
        let kind = pending
            .take()
            .or_else(|| next_kind.next())
            .unwrap_or_else(|| rng.below(KINDS as u64) as usize);
        let relay = rng.below(shape.relays as u64) as usize;
        let consumer = rng.below(shape.consumers as u64) as usize;
        let any = if rng.chance(0.6) {
            Target::Relay(relay)
        } else {
            Target::Consumer(consumer)
        };
        let service = if rng.chance(0.5) {
            Service::Postgres
        } else {
            Service::Rabbitmq
        };
        let fault = match kind {
            0 => Fault::KillRelay {
                relay,
                down_ms: rng.range(300, 3_000),
            },
            1 => Fault::PauseRelay {
                relay,
                // Past the takeover time (lease + lease/3), by up to two seconds more.
                pause_ms: lease + lease / 3 + rng.range(700, 2_500),
            },
            2 => Fault::CloseAmqp {
                target: Target::Relay(relay),
            },
            3 => Fault::CloseAmqp {
                target: Target::Consumer(consumer),
            },
            4 => Fault::Blackhole {
                target: any,
                service,
                hold_ms: rng.range(1_500, 6_000),
            },
            5 => Fault::Delay {
                target: any,
                service,
                delay_ms: rng.range(50, 400),
                hold_ms: rng.range(2_000, 8_000),
            },
            6 => Fault::Reset {
                target: any,
                service,
                hold_ms: rng.range(300, 2_000),
            },
            7 => Fault::TerminatePg { target: any },
            8 => Fault::CrashConsumer { consumer },
            _ => Fault::Duplicates {
                count: rng.range(20, 120) as usize,
            },
        };
        let length = fault.length().as_millis() as u64;
        let gap = rng.range(1_500, 4_500);
        if at + length + TAIL_MS > end {
            pending = Some(kind);
            at += gap / 2;
            continue;
        }
        if let Some(t) = fault.target() {
            if busy_until.get(&t).is_some_and(|until| *until > at) {
                pending = Some(kind);
                at += gap / 2;
                continue;
            }
            // A second apart at least, so each fault's effect is its own.
            busy_until.insert(t, at + length + 1_000);
        }
        plan.push(Planned { at_ms: at, fault });
        at += gap;
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(secs: u64) -> Shape {
        Shape {
            duration: Duration::from_secs(secs),
            relays: 3,
            consumers: 2,
            lease: Duration::from_secs(3),
        }
    }

    #[test]
    fn a_seed_reproduces_its_schedule() {
        assert_eq!(draw(42, &shape(120)), draw(42, &shape(120)));
        assert_ne!(draw(42, &shape(120)), draw(43, &shape(120)));
    }

    #[test]
    fn faults_end_before_the_run_and_never_overlap_on_one_process() {
        for seed in 0..50 {
            let plan = draw(seed, &shape(90));
            let mut until: std::collections::HashMap<Target, u64> = Default::default();
            for p in &plan {
                let end = p.at_ms + p.fault.length().as_millis() as u64;
                assert!(end + TAIL_MS <= 90_000, "seed {seed}: {p:?}");
                if let Some(t) = p.fault.target() {
                    assert!(
                        until.get(&t).is_none_or(|u| *u <= p.at_ms),
                        "seed {seed}: {p:?}"
                    );
                    until.insert(t, end);
                }
            }
        }
    }

    #[test]
    fn a_minute_injects_every_kind_and_pauses_outlast_the_takeover() {
        let plan = draw(7, &shape(60));
        let kinds: std::collections::HashSet<_> = plan
            .iter()
            .map(|p| std::mem::discriminant(&p.fault))
            .collect();
        assert_eq!(kinds.len(), 9, "{plan:#?}");
        for p in &plan {
            if let Fault::PauseRelay { pause_ms, .. } = p.fault {
                assert!(pause_ms > 4_000);
            }
        }
    }
}
