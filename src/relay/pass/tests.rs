//! Unit tests of the claim pass: the look-back window, the cursor, sweeps alternating with
//! forward claims, wake-ups surviving a claim, and the backoff after a failed claim.

use super::*;

const W: Duration = Duration::from_millis(100);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn key(k: &str) -> Key {
    Key {
        aggregate_type: "order".into(),
        aggregate_id: k.into(),
    }
}

/// While forward claims keep up, the next one reads again from where the claims of the
/// last window started; that start moves up as claims age out of the window.
#[test]
fn caught_up_claims_read_the_last_window_again() {
    let t0 = Instant::now();
    let mut pass = Pass::new();
    assert_eq!(pass.forward_from(t0, W), 0);
    pass.forward_done(t0, 100, true);
    pass.forward_done(t0 + ms(40), 150, true);
    pass.forward_done(t0 + ms(80), 170, true);
    assert_eq!(pass.cursor, 170);
    // The first claim (from 0) is still within the window.
    assert_eq!(pass.forward_from(t0 + ms(90), W), 0);
    // It aged out; the second passed from 100.
    assert_eq!(pass.forward_from(t0 + ms(120), W), 100);
    assert_eq!(pass.forward_from(t0 + ms(170), W), 150);
    // Nothing passed in the last window: read from the cursor.
    assert_eq!(pass.forward_from(t0 + ms(400), W), 170);
}

/// A claim that read from further back and reached the end never moves the cursor back;
/// one that stopped at its limit goes on from there (below the cursor), and until claims
/// keep up again they read from the cursor only.
#[test]
fn a_claim_from_further_back_moves_the_cursor_back_only_when_cut() {
    let t0 = Instant::now();
    let mut pass = Pass::new();
    pass.forward_done(t0, 500, true);
    assert_eq!(pass.forward_from(t0 + ms(1), W), 0);
    pass.forward_done(t0 + ms(1), 300, true);
    assert_eq!(pass.cursor, 500, "reached the end below the cursor");
    pass.forward_done(t0 + ms(2), 200, false);
    assert_eq!(pass.cursor, 200, "cut at its limit: go on from there");
    assert_eq!(pass.forward_from(t0 + ms(3), W), 200, "not caught up");
}

/// A sweep reads below the cursor in claims that alternate with forward ones while a
/// forward claim is wanted, and never moves the cursor.
#[tokio::test(start_paused = true)]
async fn sweeps_alternate_with_forward_claims() {
    let mut pass = Pass::new();
    // The first claim: a sweep was wanted, but the range below the cursor (0) is empty.
    let first = pass.start(Instant::now(), 100, W);
    assert_eq!(
        (first.after, first.before, first.sweeping),
        (0, Some(0), true)
    );
    assert!(!pass.due(Instant::now()), "one claim at a time");
    pass.returned(Instant::now(), true, 0, true, 0, false);
    // The forward claim the start asked for is still wanted.
    assert!(pass.due(Instant::now()));
    let forward = pass.start(Instant::now(), 100, W);
    assert_eq!(
        (forward.after, forward.before, forward.sweeping),
        (0, None, false)
    );
    pass.returned(Instant::now(), false, 1000, false, 100, false);
    assert!(pass.wanted(), "cut at its limit: claim again");

    tokio::time::advance(ms(500)).await; // out of the look-back window
    pass.want_sweep(); // a poll tick
    let sweep = pass.start(Instant::now(), 100, W);
    assert_eq!(
        (sweep.after, sweep.before, sweep.sweeping),
        (0, Some(1000), true)
    );
    pass.returned(Instant::now(), true, 400, false, 0, false);
    // Still sweeping: the next claim reads forward, the one after that sweeps on.
    let forward = pass.start(Instant::now(), 100, W);
    assert_eq!((forward.after, forward.sweeping), (1000, false));
    pass.returned(Instant::now(), false, 1010, true, 0, false);
    let sweep = pass.start(Instant::now(), 100, W);
    assert_eq!(
        (sweep.after, sweep.before),
        (400, Some(1000)),
        "sweep goes on"
    );
    pass.returned(Instant::now(), true, 1000, true, 0, false);
    assert_eq!(pass.cursor, 1010, "sweeps never move the cursor");
    // The sweep is done; the forward claim the last one asked for is still wanted, and
    // reads again from where the claims of the window started.
    let forward = pass.start(Instant::now(), 100, W);
    assert_eq!((forward.after, forward.sweeping), (1000, false));
    pass.returned(Instant::now(), false, 1010, true, 0, false);
    assert!(!pass.due(Instant::now()), "caught up, nothing wanted");
}

/// A wake-up that arrives while a claim runs survives its return.
#[test]
fn a_wake_up_during_a_claim_survives_it() {
    let mut pass = Pass::new();
    pass.start(Instant::now(), 100, W);
    pass.returned(Instant::now(), true, 0, true, 0, false);
    pass.start(Instant::now(), 100, W);
    assert!(!pass.wanted());
    pass.want(); // NOTIFY while the claim runs
    pass.returned(Instant::now(), false, 10, true, 0, false);
    assert!(pass.wanted());
    assert!(pass.due(Instant::now()));
}

/// A claim that read to the end and found rows claims again at once, unless commits are
/// announced (then the next commit's NOTIFY starts the next claim); a NOTIFY that came
/// while it ran, or a claim cut short by its limit, still claims again.
#[test]
fn rows_found_while_commits_are_announced_want_no_follow_up_claim() {
    let mut pass = Pass::new();
    pass.start(Instant::now(), 100, W);
    pass.returned(Instant::now(), true, 0, true, 0, false);

    pass.start(Instant::now(), 100, W);
    pass.returned(Instant::now(), false, 10, true, 3, false);
    assert!(
        pass.wanted(),
        "not announced: more may be coming, claim again"
    );

    pass.start(Instant::now(), 100, W);
    pass.returned(Instant::now(), false, 20, true, 3, true);
    assert!(
        !pass.wanted(),
        "announced: the next commit starts the claim"
    );

    pass.start(Instant::now(), 100, W);
    pass.want(); // NOTIFY while the claim runs
    pass.returned(Instant::now(), false, 30, true, 3, true);
    assert!(pass.wanted(), "a wake-up during the claim survives it");

    pass.start(Instant::now(), 100, W);
    pass.returned(Instant::now(), false, 130, false, 100, true);
    assert!(pass.wanted(), "stopped at its limit: read on");
}

/// Keys asked for by name take at most a quarter of a claim; the rest wait for the next.
#[test]
fn named_keys_take_a_quarter_of_a_claim() {
    let mut pass = Pass::new();
    pass.start(Instant::now(), 100, W);
    pass.returned(Instant::now(), true, 0, true, 0, false);
    for k in ["a", "b", "c"] {
        pass.continue_key(key(k));
    }
    let plan = pass.start(Instant::now(), 8, W);
    assert_eq!(plan.keys.len(), 2);
    pass.returned(Instant::now(), false, 0, true, 0, false);
    assert!(pass.wanted(), "a named key is left: claim again");
    assert_eq!(pass.start(Instant::now(), 8, W).keys.len(), 1);
}

/// A failed claim is tried again, with a sweep, after its backoff; busy polling waits
/// until the time it was given.
#[tokio::test(start_paused = true)]
async fn failed_claims_and_busy_polls_wait() {
    let mut pass = Pass::new();
    pass.start(Instant::now(), 100, W);
    pass.failed(&"connection refused");
    assert!(!pass.due(Instant::now()), "backing off");
    let due = pass.next_due().expect("waits on time");
    tokio::time::advance(due - Instant::now()).await;
    assert!(pass.due(Instant::now()));
    let plan = pass.start(Instant::now(), 100, W);
    assert!(
        !plan.sweeping,
        "the failed claim was a sweep: forward first"
    );
    pass.returned(Instant::now(), false, 0, true, 0, false);
    let plan = pass.start(Instant::now(), 100, W);
    assert!(plan.sweeping, "then the sweep the failure asked for");
    pass.returned(Instant::now(), true, 0, true, 0, false);
    let plan = pass.start(Instant::now(), 100, W);
    assert!(!plan.sweeping);
    pass.returned(Instant::now(), false, 0, true, 0, false);
    assert_eq!(pass.next_due(), None, "nothing wanted");
}

/// A claim said when the next scheduled row becomes due: a forward claim is due then,
/// however long the poll interval, and not before; the earliest such time is kept.
#[tokio::test(start_paused = true)]
async fn a_scheduled_row_wakes_a_forward_claim_when_due() {
    let mut pass = Pass::new();
    pass.start(Instant::now(), 100, W);
    pass.returned(Instant::now(), true, 0, true, 0, false);
    pass.start(Instant::now(), 100, W);
    pass.returned(Instant::now(), false, 10, true, 0, false);
    assert!(!pass.due(Instant::now()), "caught up, nothing wanted");
    let at = Instant::now() + ms(2000);
    pass.wake_at(at + ms(500));
    pass.wake_at(at);
    pass.wake_at(at + ms(100));
    assert_eq!(pass.next_due(), Some(at), "the earliest is kept");
    tokio::time::advance(ms(1999)).await;
    assert!(!pass.due(Instant::now()), "not before it is due");
    tokio::time::advance(ms(1)).await;
    assert!(pass.due(Instant::now()));
    assert_eq!(
        pass.next_due(),
        None,
        "a time already past is no timer (the engine may be unable to claim yet)"
    );
    tokio::time::advance(ms(50)).await;
    assert!(pass.due(Instant::now()), "still due until a claim starts");
    let plan = pass.start(Instant::now(), 100, W);
    assert!(!plan.sweeping, "a forward claim reads the due rows");
    pass.returned(Instant::now(), false, 10, true, 0, false);
    assert_eq!(pass.next_due(), None, "woken once");
    assert!(!pass.due(Instant::now()));
}
