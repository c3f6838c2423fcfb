//! Relay core: the contract end to end, wake-ups, failures and crashes.

use std::time::Duration;

use serde_json::Value;

use crate::support::checker::check;
use crate::support::{Broker, InProcessRelay, TestDb, test_config};

/// 10,000 events from 4 producer connections (plain INSERT and outbox_enqueue) arrive
/// once each with the contract's properties, headers and body; all rows end dispatched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_events_arrive_once_with_the_contract() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));

    let mut producers = Vec::new();
    for p in 0..4 {
        let client = db.client().await;
        producers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for batch in 0..25 {
                let tx_ids: Vec<uuid::Uuid> = if p % 2 == 0 {
                    let rows = client
                        .query(
                            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers)
                             SELECT 'order', 'p' || $1::int || '-' || (g % 50), 'created',
                                    jsonb_build_object('producer', $1::int, 'n', g), '{\"tenant\": \"acme\"}'
                               FROM generate_series(1, 100) AS g RETURNING event_id",
                            &[&p],
                        )
                        .await
                        .unwrap();
                    rows.iter().map(|r| r.get(0)).collect()
                } else {
                    let mut v = Vec::new();
                    for g in 0..100 {
                        let row = client
                            .query_one(
                                "SELECT outbox_enqueue('invoice', $1, 'issued', jsonb_build_object('b', $2::int, 'g', $3::int))",
                                &[&format!("p{p}-{}", g % 50), &batch, &g],
                            )
                            .await
                            .unwrap();
                        v.push(row.get(0));
                    }
                    v
                };
                ids.extend(tx_ids);
            }
            ids
        }));
    }
    let mut committed = Vec::new();
    for p in producers {
        committed.extend(p.await.unwrap());
    }
    assert_eq!(committed.len(), 10_000);
    broker.wait_count(10_000, Duration::from_secs(120)).await;
    let client = db.client().await;
    crate::support::wait_for("all rows dispatched", Duration::from_secs(30), || async {
        (db.count(&client, "dispatched_at IS NULL").await == 0).then_some(())
    })
    .await;
    relay.stop().await;

    let received = broker.received();
    let report = check(&committed, &received);
    report.assert_clean();
    assert_eq!(report.duplicates, 0, "{report:?}");

    // The contract, checked on one message of each producer kind against its row.
    for m in [&received[0], &received[received.len() - 1]] {
        let row = client
            .query_one(
                "SELECT aggregate_type, aggregate_id, event_type, payload::text, seq,
                        extract(epoch FROM created_at)::bigint,
                        to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
                   FROM outbox_events WHERE event_id = $1::text::uuid",
                &[&m.message_id],
            )
            .await
            .unwrap();
        let (at, aid, et): (String, String, String) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(m.routing_key, format!("{at}.{et}"));
        assert_eq!(m.content_type.as_deref(), Some("application/json"));
        assert_eq!(m.kind.as_deref(), Some(et.as_str()));
        assert_eq!(m.delivery_mode, Some(2));
        assert_eq!(m.timestamp, Some(row.get::<_, i64>(5) as u64));
        assert_eq!(
            m.header_str("x-outbox-aggregate-type").as_deref(),
            Some(at.as_str())
        );
        assert_eq!(
            m.header_str("x-outbox-aggregate-id").as_deref(),
            Some(aid.as_str())
        );
        assert_eq!(m.seq(), Some(row.get::<_, i64>(4)));
        assert_eq!(
            m.header_str("x-outbox-created-at"),
            Some(row.get::<_, String>(6))
        );
        let body: Value = serde_json::from_slice(&m.body).unwrap();
        let payload: Value = serde_json::from_str(&row.get::<_, String>(3)).unwrap();
        assert_eq!(body, payload);
        if at == "order" {
            assert_eq!(m.header_str("tenant").as_deref(), Some("acme"));
        }
    }
    // Per key, seq is 1, 2, 3, ... in publish order.
    let gaps = client
        .query_one(
            "SELECT count(*) FROM (SELECT aggregate_type, aggregate_id, count(*) AS n, max(seq) AS m, count(DISTINCT seq) AS d
               FROM outbox_events GROUP BY 1, 2) k WHERE n <> m OR n <> d",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(gaps, 0, "every key's seq runs 1..n without gaps or repeats");
}
