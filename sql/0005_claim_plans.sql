-- outbox_claim plans its statements with each call's values, on every call.
--
-- PL/pgSQL caches the plans of a function's statements per connection. After five calls
-- Postgres may switch a statement to a generic plan, made without the parameter values,
-- and keeps it for as long as the connection lives and the table's statistics do not
-- change (with autovacuum off they never do). The benchmark found two such plans:
--   * made while the table was nearly empty (a relay that starts and claims the first
--     few rows as they come), the claim's steps read the whole table sequentially instead
--     of by index; each claim then got slower as rows accumulated (latency at 1,000
--     events/s: p50 from 8 to 30 ms within 30 s);
--   * made on a big table, the numbering step guessed one picked row instead of hundreds
--     and joined rows to their keys' new counters in a nested loop: 90 ms instead of
--     15 ms for a 500-row claim (a drain at 0.71 of an empty table's rate with 5 million
--     dispatched rows in the table).
-- Planning each call costs about 0.7 ms per claim and keeps every claim's plan fitted to
-- the rows it actually reads.
ALTER FUNCTION outbox_claim(text, bigint, integer, integer, boolean, integer, bigint, text[], text[], bigint)
    SET plan_cache_mode = force_custom_plan;
