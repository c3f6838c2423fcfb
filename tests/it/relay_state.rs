//! The relay's state writes in SQL, driven the way a relay drives them: failure and park
//! writes are fenced on the lease, a retried park is told apart from a row someone else
//! finished, and numbers handed out after a re-drive never repeat a published one.

use tokio_postgres::Client;

use crate::support::TestDb;

/// Leases every partition to `relay` and returns the epochs it holds them at.
async fn lease_all(client: &Client, relay: &str) -> (Vec<i32>, Vec<i64>) {
    let rows = client
        .query(
            "UPDATE outbox_partitions SET owner = $1, epoch = epoch + 1,
                    lease_until = now() + interval '1 hour'
              RETURNING partition, epoch",
            &[&relay],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|r| (r.get::<_, i32>(0), r.get::<_, i64>(1)))
        .unzip()
}

async fn insert(client: &Client, key: &str, n: i32) {
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'acct', $1, 'e' || g, '{}' FROM generate_series(1, $2) g",
            &[&key, &n],
        )
        .await
        .unwrap();
}

/// (id, seq) of the rows one claim returns, in seq order.
async fn claim(client: &Client, relay: &str) -> Vec<(i64, i64)> {
    client
        .query(
            "SELECT id, seq FROM outbox_claim($1, 0, 10, 10, true, 1048576, 1048576)
              WHERE id IS NOT NULL ORDER BY seq",
            &[&relay],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// outbox_record_failures for one row: (attempts, parked, outcome) of each returned row.
async fn park(
    client: &Client,
    id: i64,
    relay: &str,
    leases: &(Vec<i32>, Vec<i64>),
) -> Vec<(i32, bool, String)> {
    client
        .query(
            "SELECT attempts, parked, outcome
               FROM outbox_record_failures(ARRAY[$1::bigint], ARRAY['too large'], ARRAY[2::smallint],
                                           10, true, $2, $3, $4)",
            &[&id, &relay, &leases.0, &leases.1],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

async fn mark(client: &Client, rows: &[(i64, i64)]) {
    let (ids, seqs): (Vec<i64>, Vec<i64>) = rows.iter().copied().unzip();
    client
        .execute(outbox_relay::relay::claim::MARK, &[&ids, &seqs])
        .await
        .unwrap();
}

/// The review's reproduction: a block-key park whose COMMIT the relay did not see is
/// retried. The retry must say the row is parked (so the relay stops the key); and even a
/// relay that carried on and published the key's later rows cannot make a re-drive hand
/// out their numbers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_block_key_park_is_seen_and_numbers_never_repeat() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let leases = lease_all(&client, "r").await;
    insert(&client, "a1", 3).await;
    let first = claim(&client, "r").await;
    assert_eq!(first.iter().map(|r| r.1).collect::<Vec<_>>(), [1, 2, 3]);
    let (r1, r2, r3) = (first[0].0, first[1].0, first[2].0);

    assert_eq!(
        park(&client, r1, "r", &leases).await,
        [(1, true, "recorded".into())]
    );
    // The same call again, as a relay retries after losing the answer: the row is parked.
    assert_eq!(
        park(&client, r1, "r", &leases).await,
        [(1, true, "parked".into())]
    );

    // A relay that (before this fix) carried the key on: rows 2 and 3 go out as 2 and 3.
    mark(&client, &[(r2, 2), (r3, 3)]).await;
    client
        .execute("SELECT * FROM outbox_redrive(ARRAY[$1::bigint])", &[&r1])
        .await
        .unwrap();
    insert(&client, "a1", 1).await;
    let next = claim(&client, "r").await;
    let published: Vec<i64> = client
        .query(
            "SELECT seq FROM outbox_events WHERE dispatched_at IS NOT NULL ORDER BY seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(published, [2, 3]);
    let seqs: Vec<i64> = next.iter().map(|r| r.1).collect();
    assert_eq!(
        seqs,
        [4, 5],
        "after a re-drive, numbers continue above every published one"
    );
    assert_eq!(next[0].0, r1, "the re-driven row goes first");
}

/// A relay whose lease lapsed, or whose partition another relay took, cannot park, rewind
/// or count attempts on that partition's rows; it learns the row is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_writes_are_fenced_on_the_lease() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let old = lease_all(&client, "old").await;
    insert(&client, "a1", 2).await;
    let rows = claim(&client, "old").await;
    let r1 = rows[0].0;

    // Another relay takes every partition (new epochs).
    let new = lease_all(&client, "new").await;
    assert_eq!(
        park(&client, r1, "old", &old).await,
        [(0, false, "fenced".into())]
    );
    // The right owner but an old epoch: fenced too.
    assert_eq!(
        park(&client, r1, "new", &old).await,
        [(0, false, "fenced".into())]
    );
    // A lapsed lease: fenced.
    client
        .execute(
            "UPDATE outbox_partitions SET lease_until = now() - interval '1 second'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        park(&client, r1, "new", &new).await,
        [(0, false, "fenced".into())]
    );
    let untouched: (i32, bool) = client
        .query_one(
            "SELECT attempts, parked_at IS NOT NULL FROM outbox_events WHERE id = $1",
            &[&r1],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(untouched, (0, false));

    // The owner at its epoch with a live lease records it; a dispatched row says so.
    let new = lease_all(&client, "new").await;
    assert_eq!(
        park(&client, r1, "new", &new).await,
        [(1, true, "recorded".into())]
    );
    mark(&client, &[(rows[1].0, 2)]).await;
    assert_eq!(
        park(&client, rows[1].0, "new", &new).await,
        [(0, false, "dispatched".into())]
    );
}

/// A statement the client has given up on (its deadline is 30 s) must not run on and commit
/// behind its back: the server stops it first. An operator's own setting wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_stop_on_the_server_before_the_client_gives_up() {
    let db = TestDb::new().await;
    let pool = db.target.pool(&db.schema, "it-statement-timeout", 1);
    let client = pool.get().await.unwrap();
    let shown: String = client
        .query_one("SHOW statement_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(shown, "25s");
    let own = outbox_kit::db::DbTarget::parse(&format!(
        "{}?options=-c%20statement_timeout%3D7s",
        db.url()
    ))
    .unwrap();
    let client = own.connect(&db.schema, "it-own-timeout").await.unwrap();
    let shown: String = client
        .query_one("SHOW statement_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(shown, "7s");
}

/// On the steady path a claim only reads: it takes no transaction id (so it writes nothing
/// and its commit flushes no WAL), and the rows come back with the numbers their INSERTs
/// took. A scheduled row is numbered once due, after the key's rows numbered before then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_only_reads_and_rows_are_numbered_at_insert() {
    let db = TestDb::new().await;
    let mut client = db.client().await;
    lease_all(&client, "r").await;
    insert(&client, "a1", 2).await;
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, available_at)
             VALUES ('acct', 'a1', 'later', '{}', now() + interval '1 hour')",
            &[],
        )
        .await
        .unwrap();
    insert(&client, "a1", 1).await;
    let stored: Vec<Option<i64>> = client
        .query("SELECT seq FROM outbox_events ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        stored,
        [Some(1), Some(2), None, Some(3)],
        "numbered at insert"
    );

    let tx = client.transaction().await.unwrap();
    let rows: Vec<i64> = tx
        .query(
            "SELECT seq FROM outbox_claim('r', 0, 10, 10, true, 1048576, 1048576)
              WHERE id IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows, [1, 2, 3]);
    let xid: Option<String> = tx
        .query_one("SELECT pg_current_xact_id_if_assigned()::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(xid, None, "the claim wrote nothing");
    tx.commit().await.unwrap();

    // Due now: the claim numbers it (the slow path, a write) after the key's others.
    client
        .execute(
            "UPDATE outbox_events SET available_at = now() WHERE event_type = 'later'",
            &[],
        )
        .await
        .unwrap();
    let seqs: Vec<i64> = claim(&client, "r").await.iter().map(|r| r.1).collect();
    assert_eq!(seqs, [1, 2, 3, 4]);
}

/// A key's producers take its numbers one after another until commit: a second INSERT of
/// the key waits for the first transaction, and a rollback gives its number back, so the
/// numbers committed are 1, 2, ... in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_producers_take_numbers_in_commit_order() {
    let db = TestDb::new().await;
    let mut first = db.client().await;
    let second = db.client().await;
    let tx = first.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('acct', 'a1', 'rolled_back', '{}')",
        &[],
    )
    .await
    .unwrap();
    let waiting = tokio::spawn(async move {
        second
            .query_one(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('acct', 'a1', 'kept', '{}') RETURNING seq",
                &[],
            )
            .await
            .map(|r| r.get::<_, i64>(0))
    });
    // The second INSERT waits on the key's counter row, held by the first transaction.
    let observer = db.client().await;
    crate::support::wait_for(
        "the second producer waiting for the key",
        std::time::Duration::from_secs(10),
        || async {
            let n: i64 = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (n > 0).then_some(())
        },
    )
    .await;
    assert!(!waiting.is_finished());
    tx.rollback().await.unwrap();
    let seq = tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
        .await
        .expect("the second producer goes on after the rollback")
        .unwrap()
        .unwrap();
    assert_eq!(seq, 1, "the rolled-back number is taken again");
}

/// An INSERT skipped by `ON CONFLICT (event_id) DO NOTHING` (a producer passing its own
/// event id a second time) takes no number: the key's next event gets the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_insert_leaves_no_gap() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let insert =
        "INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES ($1, 'acct', 'a1', 'e', '{}') ON CONFLICT (event_id) DO NOTHING";
    let twice = uuid::Uuid::from_u128(1);
    for id in [twice, twice, uuid::Uuid::from_u128(2)] {
        client.execute(insert, &[&id]).await.unwrap();
    }
    let seqs: Vec<i64> = client
        .query("SELECT seq FROM outbox_events ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(seqs, [1, 2]);
}
