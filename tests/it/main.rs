//! The one integration test binary (links once). Every test gets its own database and
//! its own exchange and queue, so tests run in parallel against the real services.

mod support;

mod bench_smoke;
mod relay_core;
