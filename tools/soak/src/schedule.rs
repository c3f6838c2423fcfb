//! The fault schedule: which fault, on what, when and for how long, drawn from the seed
//! alone, so a seed reproduces its schedule exactly (the timing of everything else does
//! not repeat to the millisecond, the schedule does).
//!
//! The first faults are one of each kind in a seeded order, so even a short run injects
//! every kind; after that kinds are drawn at random. Faults overlap in time, but never two
//! on the same process at once (a relay being killed is not also paused), a service is not
//! restarted while a fault that needs it (to inject or to observe) runs, nor such a fault
//! started while its service is down; every fault ends before the run's duration does:
//! the quiet period starts with a healed system. Restarts of Postgres and RabbitMQ are
//! drawn only when the soak runs its own services.

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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
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
    /// The relay's Postgres proxy goes dark the instant its AMQP proxy carries a publish:
    /// the broker acks, the mark cannot go out; once the tap has the rows and the ack has
    /// come back, SIGKILL; restart after `down_ms`.
    KillBetweenAckAndMark { relay: usize, down_ms: u64 },
    /// SIGKILL of a consumer group instance, down for `down_ms`, then a new one.
    KillConsumer { consumer: usize, down_ms: u64 },
    /// SIGSTOP of a consumer group instance for `pause_ms` (past its member lease, so the
    /// others take its partitions over), then SIGCONT.
    PauseConsumer { consumer: usize, pause_ms: u64 },
    /// Every instance of the group stopped (SIGTERM) for `stop_ms`, then started again: the
    /// queues build a backlog of `stop_ms` of production.
    StopConsumers { stop_ms: u64 },
    /// The soak's own Postgres server stopped (fast, or immediate as in a crash), down for
    /// `down_ms`, started again.
    RestartPostgres { down_ms: u64, immediate: bool },
    /// The soak's own RabbitMQ node stopped, down for `down_ms`, started again.
    RestartRabbitmq { down_ms: u64 },
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
            Fault::CrashConsumer { consumer }
            | Fault::KillConsumer { consumer, .. }
            | Fault::PauseConsumer { consumer, .. } => Some(Target::Consumer(*consumer)),
            Fault::KillBetweenAckAndMark { relay, .. } => Some(Target::Relay(*relay)),
            Fault::Duplicates { .. }
            | Fault::StopConsumers { .. }
            | Fault::RestartPostgres { .. }
            | Fault::RestartRabbitmq { .. } => None,
        }
    }

    /// The processes the fault holds: its target, or every consumer instance.
    pub fn holds(&self, consumers: usize) -> Vec<Target> {
        match self {
            Fault::StopConsumers { .. } => (0..consumers).map(Target::Consumer).collect(),
            _ => self.target().into_iter().collect(),
        }
    }

    /// The service the fault restarts.
    pub fn restarts(&self) -> Option<Service> {
        match self {
            Fault::RestartPostgres { .. } => Some(Service::Postgres),
            Fault::RestartRabbitmq { .. } => Some(Service::Rabbitmq),
            _ => None,
        }
    }

    /// The services the soak itself needs up to inject or observe the fault.
    pub fn needs(&self) -> &'static [Service] {
        match self {
            Fault::TerminatePg { .. } => &[Service::Postgres],
            Fault::CloseAmqp { .. } => &[Service::Rabbitmq],
            Fault::Duplicates { .. }
            | Fault::KillBetweenAckAndMark { .. }
            | Fault::CrashConsumer { .. } => &[Service::Postgres, Service::Rabbitmq],
            _ => &[],
        }
    }

    /// How many relays the fault can make publish again what they published but had not
    /// marked (the duplicates the relays themselves cause): it loses their acks, marks or
    /// leases.
    pub fn relays_hit(&self, relays: usize) -> usize {
        match self {
            Fault::RestartPostgres { .. } | Fault::RestartRabbitmq { .. } => relays,
            _ if matches!(self.target(), Some(Target::Relay(_))) => 1,
            _ => 0,
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
            Fault::KillConsumer { down_ms, .. } => *down_ms,
            Fault::PauseConsumer { pause_ms, .. } => *pause_ms,
            // The instances' clean stop, then the outage.
            Fault::StopConsumers { stop_ms } => 5_000 + *stop_ms,
            // Waiting for a publish, the tap and the ack, then the restart.
            Fault::KillBetweenAckAndMark { down_ms, .. } => 3_000 + *down_ms,
            // Stop and start take seconds of their own (measured on the 2-core machine:
            // Postgres about 1 s; a RabbitMQ node 4 s to stop and 9 s to start idle, up to
            // 30 s in all under the soak's load). The soak holds faults that need a service
            // until its restart is over, whatever the plan said.
            Fault::RestartPostgres { down_ms, .. } => 3_000 + *down_ms,
            Fault::RestartRabbitmq { down_ms } => 20_000 + *down_ms,
        })
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
            Fault::KillBetweenAckAndMark { relay, down_ms } => write!(
                f,
                "SIGKILL relay {relay} between the broker's ack and its mark, restart after {}",
                s(down_ms)
            ),
            Fault::KillConsumer { consumer, down_ms } => write!(
                f,
                "SIGKILL consumer {consumer}, restart after {}",
                s(down_ms)
            ),
            Fault::PauseConsumer { consumer, pause_ms } => write!(
                f,
                "SIGSTOP consumer {consumer} for {}, then SIGCONT",
                s(pause_ms)
            ),
            Fault::StopConsumers { stop_ms } => write!(
                f,
                "stop every consumer instance for {} (a backlog), then start them",
                s(stop_ms)
            ),
            Fault::RestartPostgres { down_ms, immediate } => write!(
                f,
                "restart Postgres ({} stop, down {})",
                if *immediate { "immediate" } else { "fast" },
                s(down_ms)
            ),
            Fault::RestartRabbitmq { down_ms } => {
                write!(f, "restart the RabbitMQ node (down {})", s(down_ms))
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
    /// The soak runs its own Postgres and RabbitMQ: it may restart them.
    pub own_services: bool,
    /// The longest outage of every consumer instance (zero: none); drawn between half of it
    /// and all of it.
    pub backlog: Duration,
    /// The consumers' member lease: a pause of an instance outlasts it.
    pub member_lease: Duration,
}

/// Kinds of fault: 0-13 always (13 only with a backlog), 14-15 with the soak's own services.
const KINDS: usize = 16;
const STOP_CONSUMERS: usize = 13;
const RESTARTS: [usize; 2] = [14, 15];

/// Seconds before the first fault: relays and consumers are up and the stream flows.
const WARMUP_MS: u64 = 5_000;
/// Every fault ends this long before the duration does.
const TAIL_MS: u64 = 1_500;

pub fn draw(seed: u64, shape: &Shape) -> Vec<Planned> {
    let mut rng = Rng::new(seed).fork(1);
    let end = shape.duration.as_millis() as u64;
    let lease = shape.lease.as_millis() as u64;
    let kinds: Vec<usize> = (0..KINDS)
        .filter(|k| shape.own_services || !RESTARTS.contains(k))
        .filter(|k| !shape.backlog.is_zero() || *k != STOP_CONSUMERS)
        .collect();
    let backlog = shape.backlog.as_millis() as u64;
    let member_lease = shape.member_lease.as_millis() as u64;
    let mut busy_until: std::collections::HashMap<Target, u64> = Default::default();
    // Per service: until when it is down (restarted), and until when a fault needs it.
    let mut down_until: std::collections::HashMap<Service, u64> = Default::default();
    let mut needed_until: std::collections::HashMap<Service, u64> = Default::default();
    let mut first = kinds.clone();
    rng.shuffle(&mut first);
    let mut next_kind = first.into_iter();
    let mut plan = Vec::new();
    let mut at = WARMUP_MS;
    // A kind that could not go where it was drawn (its process or service busy) is tried
    // again at the next slot, so the first round still brings every kind; meanwhile up to
    // two other kinds are tried in the same slot, so a busy service does not stall the rest.
    let mut deferred: std::collections::VecDeque<usize> = Default::default();
    let mut tries = 0;
    // After every consumer instance was stopped for L, the next such stop waits 3 L after
    // it ended: the group is down at most a quarter of the run and has time to catch up.
    let mut next_stop_consumers = 0;
    while at + TAIL_MS + 500 < end {
        let kind = (if tries == 0 {
            deferred.pop_front()
        } else {
            None
        })
        .or_else(|| next_kind.next())
        .unwrap_or_else(|| kinds[rng.below(kinds.len() as u64) as usize]);
        if kind == STOP_CONSUMERS && at < next_stop_consumers {
            continue;
        }
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
            9 => Fault::Duplicates {
                count: rng.range(20, 120) as usize,
            },
            10 => Fault::KillBetweenAckAndMark {
                relay,
                down_ms: rng.range(300, 2_000),
            },
            11 => Fault::KillConsumer {
                consumer,
                down_ms: rng.range(300, 3_000),
            },
            12 => Fault::PauseConsumer {
                consumer,
                // Past the member lease, by up to three seconds more.
                pause_ms: member_lease + rng.range(1_000, 3_000),
            },
            STOP_CONSUMERS => Fault::StopConsumers {
                stop_ms: rng.range(backlog / 2, backlog.max(2)),
            },
            14 => Fault::RestartPostgres {
                down_ms: rng.range(500, 5_000),
                immediate: rng.chance(0.5),
            },
            _ => Fault::RestartRabbitmq {
                down_ms: rng.range(500, 5_000),
            },
        };
        let length = fault.length().as_millis() as u64;
        let gap = rng.range(1_500, 4_500);
        if at + length + TAIL_MS > end {
            // Too long for what is left of the run: the next kinds may still fit.
            tries = 0;
            at += gap / 2;
            continue;
        }
        let until = |m: Option<&u64>| m.is_some_and(|u| *u > at);
        let holds = fault.holds(shape.consumers);
        let blocked = holds.iter().any(|t| until(busy_until.get(t)))
            || fault.needs().iter().any(|s| until(down_until.get(s)))
            || fault
                .restarts()
                .is_some_and(|s| until(down_until.get(&s)) || until(needed_until.get(&s)));
        if blocked {
            if !deferred.contains(&kind) {
                deferred.push_back(kind);
            }
            tries += 1;
            if tries == 3 {
                tries = 0;
                at += gap / 2;
            }
            continue;
        }
        tries = 0;
        // A second apart at least, so each fault's effect is its own.
        for t in holds {
            busy_until.insert(t, at + length + 1_000);
        }
        for s in fault.needs() {
            let until = needed_until.entry(*s).or_default();
            *until = (*until).max(at + length + 1_000);
        }
        if let Some(s) = fault.restarts() {
            down_until.insert(s, at + length + 1_000);
        }
        if kind == STOP_CONSUMERS {
            next_stop_consumers = at + 4 * length;
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
            own_services: true,
            backlog: Duration::from_secs(10),
            member_lease: Duration::from_secs(6),
        }
    }

    #[test]
    fn every_consumer_is_stopped_at_most_a_quarter_of_the_run() {
        let long = Shape {
            backlog: Duration::from_secs(60),
            ..shape(900)
        };
        for seed in 0..20 {
            let stops: Vec<u64> = draw(seed, &long)
                .iter()
                .filter(|p| matches!(p.fault, Fault::StopConsumers { .. }))
                .map(|p| p.fault.length().as_millis() as u64)
                .collect();
            assert!(!stops.is_empty(), "seed {seed}");
            let down: u64 = stops.iter().sum();
            assert!(down <= 900_000 / 4 + 60_000, "seed {seed}: {stops:?}");
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
                for t in p.fault.holds(2) {
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
    fn no_service_restarts_while_a_fault_needs_it_nor_on_shared_services() {
        for seed in 0..50 {
            let plan = draw(seed, &shape(120));
            for r in plan.iter().filter(|p| p.fault.restarts().is_some()) {
                let s = r.fault.restarts().unwrap();
                let (r0, r1) = (r.at_ms, r.at_ms + r.fault.length().as_millis() as u64);
                for p in plan.iter().filter(|p| p.fault.needs().contains(&s)) {
                    let (p0, p1) = (p.at_ms, p.at_ms + p.fault.length().as_millis() as u64);
                    assert!(p1 <= r0 || r1 <= p0, "seed {seed}: {r:?} overlaps {p:?}");
                }
            }
            let shared = Shape {
                own_services: false,
                ..shape(120)
            };
            assert!(
                draw(seed, &shared)
                    .iter()
                    .all(|p| p.fault.restarts().is_none())
            );
        }
    }

    #[test]
    fn two_minutes_inject_every_kind_and_pauses_outlast_the_takeover() {
        let plan = draw(7, &shape(120));
        let kinds: std::collections::HashSet<_> = plan
            .iter()
            .map(|p| std::mem::discriminant(&p.fault))
            .collect();
        // Sixteen kinds; the two `CloseAmqp` (relay, consumer) share a variant.
        assert_eq!(kinds.len(), 15, "{plan:#?}");
        for p in &plan {
            if let Fault::PauseRelay { pause_ms, .. } = p.fault {
                assert!(pause_ms > 4_000);
            }
            if let Fault::PauseConsumer { pause_ms, .. } = p.fault {
                assert!(pause_ms > 6_000, "past the member lease");
            }
        }
    }
}
