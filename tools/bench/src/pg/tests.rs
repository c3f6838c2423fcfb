use super::*;

#[test]
fn payload_is_about_500_bytes_and_carries_its_number() {
    let p = payload_json(123_456);
    assert!((450..560).contains(&p.len()), "{} bytes", p.len());
    let v: serde_json::Value = serde_json::from_str(&p).unwrap();
    assert_eq!(v["order_id"], 123_456);
    assert_eq!(order_id_of(p.as_bytes()), Some(123_456));
    assert_eq!(order_id_of(b"{}"), None);
}

#[test]
fn payload_matches_what_postgres_prints() {
    // Printed by Postgres 15 for g = 1 from PAYLOAD_SQL.
    let expected = concat!(
        r#"{"note": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "#,
        r#""items": [{"qty": 2, "sku": "SKU-1", "price_cents": 31}, {"qty": 2, "sku": "SKU-7", "price_cents": 17}], "#,
        r#""status": "created", "currency": "EUR", "order_id": 1, "shipping": {"city": "Springfield", "#,
        r#""name": "Customer 1", "street": "1 Example Street", "country": "DE", "postcode": "00001"}, "#,
        r#""placed_at": "2026-01-01T00:00:00.000000Z", "customer_id": "cust-000001", "total_cents": 7919}"#
    );
    assert_eq!(payload_json(1), expected);
}

#[test]
fn database_name_is_replaced_in_urls() {
    assert_eq!(
        url_with_db("postgres://postgres@127.0.0.1:5432/postgres", "b"),
        "postgres://postgres@127.0.0.1:5432/b"
    );
    assert_eq!(
        url_with_db("postgres://u:p@h/x?sslmode=disable", "b"),
        "postgres://u:p@h/b?sslmode=disable"
    );
    assert_eq!(url_with_db("postgres://h:5432", "b"), "postgres://h:5432/b");
}
