//! A key: the unit of order. Its rows are published one at a time in seq order, and it lives
//! in one partition. Its own module because the claim (which asks for keys by name), the
//! hand (which queues rows per key) and the publish lanes (which report per key) all name
//! it, and none of them should depend on another for it.

/// A key: aggregate type and aggregate id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// The row's `aggregate_type`.
    pub aggregate_type: String,
    /// The row's `aggregate_id`.
    pub aggregate_id: String,
}
