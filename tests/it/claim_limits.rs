//! What one claim may cost: its rows fit the relay's memory budget however large their
//! headers, rows not yet due are never read, and what a row holds (too large, not UTF-8)
//! gets it parked with a reason while the relay goes on publishing the rest.

use std::time::Duration;

use tokio_postgres::Client;

use crate::support::checker::check;
use crate::support::{Broker, InProcessRelay, TestDb, test_config, wait_for};

/// Leases every partition to relay `r`, for claims called directly.
async fn lease_all_to_r(client: &Client) {
    client
        .batch_execute(
            "UPDATE outbox_partitions SET owner = 'r', lease_until = now() + interval '1 hour'",
        )
        .await
        .unwrap();
}

/// Inserts `n` rows of distinct keys, each with `header_bytes` of user headers.
async fn insert_with_headers(client: &Client, n: i32, header_bytes: i32) {
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers)
             SELECT 'order', 'h' || g, 'created', '{}', jsonb_build_object('blob', repeat('x', $2))
               FROM generate_series(1, $1) g",
            &[&n, &header_bytes],
        )
        .await
        .unwrap();
}

/// One claim of relay `r` (forward, up to 500 rows): (rows, sum of the sizes it reports,
/// sum of the header text it returned).
async fn claim_sizes(client: &Client, max_message: i32, budget: i64) -> (i64, i64, i64) {
    let row = client
        .query_one(
            "SELECT count(*), coalesce(sum(body_bytes), 0)::bigint,
                    coalesce(sum(octet_length(headers)), 0)::bigint
               FROM outbox_claim('r', 0, 500, 16, false, $1, $2)
              WHERE id IS NOT NULL",
            &[&max_message, &budget],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// A claim's byte budget counts each row's message as published (headers, trace context
/// and key as well as the payload): 200 rows with 50 KB of headers each come back as about
/// 1 MiB's worth when the budget is 1 MiB, not as 10 MB. The first row comes back whatever
/// its size, so a claim always makes progress.
#[tokio::test]
async fn a_claim_counts_headers_in_its_byte_budget() {
    let db = TestDb::new().await;
    let client = db.client().await;
    lease_all_to_r(&client).await;
    insert_with_headers(&client, 200, 50_000).await;

    let budget = 1 << 20;
    let (rows, sized, headers) = claim_sizes(&client, 1 << 20, budget).await;
    assert!(rows >= 1, "a claim returns a row");
    assert!(
        headers <= budget && sized <= budget,
        "{rows} rows with {headers} bytes of headers ({sized} bytes in all) for a budget of {budget}"
    );
    assert!(rows < 200, "{rows} rows: the budget cut the claim");
    assert!(
        sized >= 50_000 * rows,
        "each row's size counts its headers: {sized} bytes for {rows} rows"
    );

    let (rows, _, _) = claim_sizes(&client, 1 << 20, 1).await;
    assert_eq!(
        rows, 1,
        "a budget smaller than any row still returns the first"
    );
}

/// A row whose message (here: its headers alone) is larger than --max-message-bytes comes
/// back without payload, headers and trace context, with its size: the relay parks it
/// without holding what it will never publish, and it counts for its key only in the budget.
#[tokio::test]
async fn a_too_large_row_comes_back_without_what_makes_it_large() {
    let db = TestDb::new().await;
    let client = db.client().await;
    lease_all_to_r(&client).await;
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers, traceparent)
             VALUES ('order', 'big', 'created', '{}', jsonb_build_object('blob', repeat('x', 50000)),
                     '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01')",
        )
        .await
        .unwrap();
    insert_with_headers(&client, 50, 1_000).await;
    let rows = client
        .query(
            "SELECT aggregate_id, body IS NULL, headers IS NULL, traceparent IS NULL, body_bytes
               FROM outbox_claim('r', 0, 500, 16, false, 4096, 100000)
              WHERE id IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    let big = rows
        .iter()
        .find(|r| r.get::<_, String>(0) == "big")
        .expect("the large row is claimed (to be parked)");
    assert!(
        big.get::<_, bool>(1) && big.get::<_, bool>(2) && big.get::<_, bool>(3),
        "no body, headers or trace context"
    );
    assert!(big.get::<_, i32>(4) > 50_000, "its size counts its headers");
    assert_eq!(
        rows.len(),
        51,
        "the large row counts only its key in the 100,000-byte budget: all 51 rows fit"
    );
}

/// `headers` is bounded in the table: more than 64 KiB of JSON text is refused at insert
/// with the constraint's name; headers just under the limit still go in.
#[tokio::test]
async fn headers_over_64_kib_are_refused_at_insert() {
    let db = TestDb::new().await;
    let client = db.client().await;
    insert_with_headers(&client, 1, 60_000).await;
    let err = client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ('order', 'o1', 'created', '{}', jsonb_build_object('blob', repeat('x', 70000)))",
            &[],
        )
        .await
        .expect_err("70 KB of headers is refused");
    let db_err = err.as_db_error().expect("a server error");
    assert_eq!(db_err.code().code(), "23514", "{db_err}");
    assert_eq!(
        db_err.constraint(),
        Some("outbox_events_headers_size"),
        "{db_err}"
    );
}

/// The relay parks rows whose headers alone exceed --max-message-bytes, with the reason,
/// and goes on publishing the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_with_headers_over_the_message_limit_are_parked_while_others_flow() {
    let db = TestDb::new().await;
    let broker = Broker::new("order.#").await;
    let mut config = test_config(&broker);
    config.max_message_bytes = std::num::NonZeroUsize::new(4096).unwrap();
    let relay = InProcessRelay::start(&db, config);
    let client = db.client().await;
    insert_with_headers(&client, 20, 10_000).await;
    let routable = db.insert(&client, 100, 10).await;
    broker.wait_count(100, Duration::from_secs(30)).await;
    let parked = wait_for(
        "rows with large headers parked",
        Duration::from_secs(30),
        || async {
            let row = client
                .query_one(
                    "SELECT count(*), min(last_error) FROM outbox_events
                  WHERE aggregate_id LIKE 'h%' AND parked_at IS NOT NULL AND dispatched_at IS NULL",
                    &[],
                )
                .await
                .unwrap();
            (row.get::<_, i64>(0) == 20).then(|| row.get::<_, String>(1))
        },
    )
    .await;
    assert!(parked.contains("too large"), "{parked}");
    assert!(!relay.handle.is_finished(), "the relay keeps running");
    relay.stop().await;
    let received = broker.received();
    check(&routable, &received).assert_clean();
    assert_eq!(
        received.len(),
        100,
        "no row with large headers was published"
    );
}

/// Sums the blocks of outbox_events and its indexes that `sql` reads (in its own
/// transaction, rolled back: the claims change nothing).
async fn blocks_read(client: &Client, sql: &str) -> i64 {
    client.batch_execute("BEGIN").await.unwrap();
    client.batch_execute(sql).await.unwrap();
    let n: i64 = client
        .query_one(
            "SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid))::bigint
               FROM pg_class c
              WHERE c.oid = 'outbox_events'::regclass
                 OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'outbox_events'::regclass)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    client.batch_execute("ROLLBACK").await.unwrap();
    n
}

/// 200,000 rows scheduled for tomorrow cost a claim nothing: a sweep (from the first id)
/// and a forward claim read as many blocks of the table and its indexes with them as
/// without them. Before, both visited every one of them (about 3,000 blocks per claim).
#[tokio::test]
async fn rows_not_yet_due_cost_a_claim_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    lease_all_to_r(&client).await;
    db.insert(&client, 20, 20).await;
    let claims = "SELECT count(*) FROM outbox_claim('r', 0, 500, 16, false, 1048576, 1048576, '{}', '{}', 9000000000);
                  SELECT count(*) FROM outbox_claim('r', 0, 500, 16, false, 1048576, 1048576);";
    client.batch_execute("ANALYZE outbox_events").await.unwrap();
    let without = blocks_read(&client, claims).await;
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, available_at)
             SELECT 'order', 's' || g, 'created', '{}', now() + interval '1 day'
               FROM generate_series(1, 200000) g;
             ANALYZE outbox_events",
        )
        .await
        .unwrap();
    let with = blocks_read(&client, claims).await;
    assert!(
        with <= without + 100,
        "a sweep and a forward claim read {without} blocks without the scheduled rows, {with} with them"
    );
}

/// Waits (20 s at most) until the row of `event_id` is marked dispatched: whether that was
/// at or after its available_at, and how many seconds after.
async fn dispatched_after_due(client: &Client, event_id: uuid::Uuid) -> (bool, f64) {
    wait_for(
        "the delayed row dispatched",
        Duration::from_secs(20),
        || async {
            client
                .query_opt(
                    "SELECT dispatched_at >= available_at,
                        extract(epoch FROM dispatched_at - available_at)::float8
                   FROM outbox_events WHERE event_id = $1 AND dispatched_at IS NOT NULL",
                    &[&event_id],
                )
                .await
                .unwrap()
                .map(|r| (r.get(0), r.get(1)))
        },
    )
    .await
}

/// A row with available_at two seconds ahead is held until then and published within a
/// poll interval after it is due (and the time one claim, publish and mark take).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_row_is_published_once_due_within_a_poll_interval() {
    let db = TestDb::new().await;
    let broker = Broker::new("order.#").await;
    let mut config = test_config(&broker);
    let poll = Duration::from_millis(500);
    config.poll_interval = poll;
    let relay = InProcessRelay::start(&db, config);
    let client = db.client().await;
    let delayed: uuid::Uuid = client
        .query_one(
            "SELECT outbox_enqueue('order', 'later', 'created', '{}', '{}', now() + interval '2 seconds')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let now = db.insert(&client, 10, 10).await;
    broker.wait_all(&now, Duration::from_secs(30)).await;
    let (held, late) = dispatched_after_due(&client, delayed).await;
    assert!(held, "published {late} s after it was due: before");
    assert!(
        late <= (poll + Duration::from_secs(1)).as_secs_f64(),
        "published {late} s after it was due, with a {poll:?} poll interval"
    );
    relay.stop().await;
    let mut all = now;
    all.push(delayed);
    check(&all, &broker.received()).assert_clean();
}

/// In a SQL_ASCII database text columns hold whatever bytes were written. A row whose
/// aggregate_id or payload is not UTF-8 is parked with the reason and the columns named;
/// the relay goes on publishing the rows after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_are_not_utf8_are_parked_while_others_flow() {
    let db =
        TestDb::created_with("ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
            .await;
    let broker = Broker::new("order.#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    let client = db.client().await;
    client
        .batch_execute(
            r#"INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
               VALUES ('order', 'bad' || convert_from('\xff'::bytea, 'SQL_ASCII'), 'created', '{}'),
                      ('order', 'badpayload', 'created',
                       ('{"a": "' || convert_from('\xfe41'::bytea, 'SQL_ASCII') || '"}')::jsonb)"#,
        )
        .await
        .unwrap();
    let good = db.insert(&client, 50, 5).await;
    broker.wait_all(&good, Duration::from_secs(30)).await;
    let reasons = wait_for("rows not UTF-8 parked", Duration::from_secs(30), || async {
        let rows = client
            .query(
                "SELECT last_error FROM outbox_events
                  WHERE aggregate_id LIKE 'bad%' AND parked_at IS NOT NULL AND dispatched_at IS NULL
                  ORDER BY id",
                &[],
            )
            .await
            .unwrap();
        (rows.len() == 2).then(|| {
            rows.iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
        })
    })
    .await;
    assert!(
        reasons[0].contains("aggregate_id not valid UTF-8"),
        "{reasons:?}"
    );
    assert!(
        reasons[1].contains("payload not valid UTF-8"),
        "{reasons:?}"
    );
    assert!(!relay.handle.is_finished(), "the relay keeps running");
    let later = db.insert(&client, 10, 5).await;
    broker.wait_all(&later, Duration::from_secs(30)).await;
    relay.stop().await;
    let mut all = good;
    all.extend(later);
    check(&all, &broker.received()).assert_clean();
}

/// A relay that claims on its own only every 30 s (a 60 s poll; a lease round, which
/// renews the wake-up hint and then claims, every 30 s) still publishes a row scheduled two
/// seconds ahead as soon as it is due: the claim before said when that would be, and the
/// relay claims again then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_row_wakes_the_relay_when_due() {
    let db = TestDb::new().await;
    let broker = Broker::new("order.#").await;
    let mut config = test_config(&broker);
    config.poll_interval = Duration::from_secs(60);
    config.lease = Duration::from_secs(90);
    let relay = InProcessRelay::start(&db, config);
    let client = db.client().await;
    // The relay is up and idle (it published this row) before the scheduled one is written.
    let first = db.insert(&client, 1, 1).await;
    broker.wait_all(&first, Duration::from_secs(30)).await;
    let delayed: uuid::Uuid = client
        .query_one(
            "SELECT outbox_enqueue('order', 'later', 'created', '{}', '{}', now() + interval '2 seconds')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let (held, late) = dispatched_after_due(&client, delayed).await;
    assert!(
        held && late <= 5.0,
        "published {late} s after it was due, with a 60 s poll interval"
    );
    relay.stop().await;
}
