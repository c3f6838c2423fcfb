-- outbox-relay: least-privilege roles. NOT a migration.
--
-- Apply once per database, after the migrations, as the owner of the outbox schema (or a
-- superuser), and again after every upgrade that adds migrations (it is idempotent: it
-- creates missing roles, then revokes and re-grants exactly the privileges below):
--
--   psql "postgres://owner@db.internal:5432/app" -v ON_ERROR_STOP=1 \
--        -v schema=public \
--        -v relay_password="$RELAY_PW" -v producer_password="$APP_PW" \
--        -f sql/roles.sql
--
-- psql variables (all optional):
--   schema            schema of outbox_events (the relay's --schema); default public
--   relay_role        default outbox_relay     (runs `outbox-relay run --no-migrate`)
--   producer_role     default outbox_producer  (services that write events)
--   consumer_role     default outbox_consumer  (consumer-kit tables and functions)
--   relay_password, producer_password, consumer_password
--                     set the role's password; left unset, an existing password is kept
--                     and a new role gets none (certificate or peer auth, or GRANT the role
--                     to your own login roles: GRANT outbox_producer TO orders_service)
--
-- Roles are cluster-wide; the grants are per database. A password given here travels in
-- the ALTER ROLE statement: on a server that logs DDL (log_statement = ddl/all), set it
-- with psql's \password instead.
--
-- Every function of the relay and the consumer kit but two is SECURITY INVOKER: it runs
-- with the caller's privileges, so each role gets exactly what its functions touch, and
-- PUBLIC's default EXECUTE on those functions is revoked. The two run as the owner:
-- outbox_refresh_statistics, because ANALYZE needs the owner; it analyzes outbox_events
-- and nothing else (when the statistics say fewer rows are pending than a claim saw;
-- sql/0007); and outbox_number_event, the insert trigger that takes the key's next seq in
-- outbox_key_seq, so that producers need no grant there and cannot move a counter
-- (sql/0015). Six pure helpers stay executable by everyone
-- (outbox_headers_allowed, used by a CHECK constraint; outbox_partition_of;
-- outbox_claim_lock_key; outbox_uuid_v7, the event_id default; outbox_utf8_valid;
-- outbox_contract_version, which every client may ask): they read no table.
--
-- Migrations are not the relay role's job: run `outbox-relay migrate` as the owner, and
-- `outbox-relay run --no-migrate` as the relay role (without --no-migrate it exits 1 with
-- "permission denied").

\set ON_ERROR_STOP on
\set QUIET on

\if :{?schema}
\else
\set schema public
\endif
\if :{?relay_role}
\else
\set relay_role outbox_relay
\endif
\if :{?producer_role}
\else
\set producer_role outbox_producer
\endif
\if :{?consumer_role}
\else
\set consumer_role outbox_consumer
\endif

BEGIN;

-- Refuse to run before the migrations (the grants below would fail one by one).
SELECT set_config('outbox.roles_schema', :'schema', true) AS schema \gset outbox_roles_
DO $$
BEGIN
    IF to_regclass(format('%I.outbox_events', current_setting('outbox.roles_schema'))) IS NULL
       OR to_regclass(format('%I.outbox_effects', current_setting('outbox.roles_schema'))) IS NULL THEN
        RAISE EXCEPTION 'schema "%" has no outbox tables', current_setting('outbox.roles_schema')
            USING HINT = 'run outbox-relay migrate (as the owner) first, then apply roles.sql';
    END IF;
END
$$;

-- The roles, created when missing. An existing role keeps its attributes.
SELECT format('CREATE ROLE %I LOGIN', r.name)
  FROM unnest(ARRAY[:'relay_role', :'producer_role', :'consumer_role']) AS r(name)
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r.name)
\gexec

\if :{?relay_password}
ALTER ROLE :"relay_role" PASSWORD :'relay_password';
\endif
\if :{?producer_password}
ALTER ROLE :"producer_role" PASSWORD :'producer_password';
\endif
\if :{?consumer_password}
ALTER ROLE :"consumer_role" PASSWORD :'consumer_password';
\endif

GRANT CONNECT ON DATABASE :"DBNAME" TO :"relay_role", :"producer_role", :"consumer_role";
GRANT USAGE ON SCHEMA :"schema" TO :"relay_role", :"producer_role", :"consumer_role";

-- Start from nothing on every outbox table, so re-applying converges (also drops grants
-- an earlier version of this file made). Revoking a table privilege revokes its column
-- privileges too. outbox_schema_migrations and outbox_schema_functions, the ledgers of
-- `outbox-relay migrate`, stay the owner's alone: no role here reads or writes them.
REVOKE ALL ON TABLE
    :"schema".outbox_events, :"schema".outbox_key_seq, :"schema".outbox_partitions,
    :"schema".outbox_relays,
    :"schema".outbox_inbox, :"schema".outbox_inbox_keys, :"schema".outbox_inbox_gaps,
    :"schema".outbox_inbox_held, :"schema".outbox_inbox_attempts, :"schema".outbox_consumer_groups,
    :"schema".outbox_consumer_members,
    :"schema".outbox_effects, :"schema".outbox_budgets, :"schema".outbox_budget_reservations,
    :"schema".outbox_effect_strays,
    :"schema".outbox_replays, :"schema".outbox_retention_horizon
    FROM :"relay_role", :"producer_role", :"consumer_role";

---------------------------------------------------------------------------------------------
-- Relay: claims, numbers, marks, parks and (with --retention) deletes rows; leases
-- partitions; keeps its heartbeat. Also enough for the operator commands (status, parked
-- list, redrive) and the dashboard's re-drive.

-- outbox_claim and the operator commands read rows; --retention deletes dispatched ones.
GRANT SELECT, DELETE ON :"schema".outbox_events TO :"relay_role";
-- Only the columns the relay manages: it can never change what a producer wrote.
-- (mark: dispatched_at, seq; outbox_record_failures: attempts, last_error,
-- parked_at, seq; outbox_redrive: parked_at, attempts, seq.)
GRANT UPDATE (dispatched_at, attempts, last_error, parked_at, seq)
    ON :"schema".outbox_events TO :"relay_role";
-- outbox_claim numbers scheduled rows once due (outbox_number_due: the key's last seq);
-- outbox_record_failures (--on-park block-key) records the parked seq (blocked_seq);
-- outbox_redrive gives re-driven rows the key's next numbers.
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_key_seq TO :"relay_role";
-- outbox_set_wakeup publishes the insert wake-up hint (setval); every role reads it in the
-- trigger (SELECT is granted to PUBLIC by migration 0008).
GRANT UPDATE ON SEQUENCE :"schema".outbox_wakeup TO :"relay_role";
-- outbox_lease / outbox_leave / outbox_claim: the 64 rows exist; only owners change.
GRANT SELECT, UPDATE (owner, epoch, lease_until) ON :"schema".outbox_partitions TO :"relay_role";
-- outbox_lease: heartbeat upsert, forgetting silent relays; set_wakeup; outbox_leave.
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".outbox_relays TO :"relay_role";
-- Deleting dispatched rows (--retention) records how far deletion reached (the trigger
-- outbox_events_deleted, 0018), which `replay` reads to refuse a range that is gone.
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_retention_horizon TO :"relay_role";
-- `outbox-relay replay` keeps each named replay's selection and progress (0018).
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_replays TO :"relay_role";

---------------------------------------------------------------------------------------------
-- Producer: writes events, nothing else.

-- Only the columns a producer writes (the relay's columns take their defaults). event_id
-- may be given by the producer (the Rust API generates it client-side).
GRANT INSERT (event_id, aggregate_type, aggregate_id, event_type, payload, headers,
              routing_key, available_at, traceparent, tracestate, idempotency_key)
    ON :"schema".outbox_events TO :"producer_role";
-- `INSERT ... RETURNING event_id` and outbox_enqueue (which returns the new event_id) need
-- to read that column; an idempotent enqueue (0017) finds the event that holds its key by
-- aggregate_type and idempotency_key. No other column: a producer cannot read payloads,
-- aggregate ids or state.
GRANT SELECT (event_id, aggregate_type, idempotency_key)
    ON :"schema".outbox_events TO :"producer_role";
-- Nothing of outbox_relays: the insert trigger reads the wake-up hint from the sequence
-- outbox_wakeup (migration 0008), which every role may read. (The REVOKE above takes back
-- the column grants an earlier version of this file made.)

---------------------------------------------------------------------------------------------
-- Consumer kit (0003): inbox, ordered keys, gaps, effects ledger, budgets. The handler's
-- own tables are yours to grant.

GRANT SELECT, INSERT, DELETE ON :"schema".outbox_inbox TO :"consumer_role";
-- outbox_inbox_dead: ON CONFLICT DO UPDATE of an earlier outcome.
GRANT UPDATE (outcome, reason) ON :"schema".outbox_inbox TO :"consumer_role";
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_inbox_keys TO :"consumer_role";
GRANT SELECT, INSERT ON :"schema".outbox_inbox_gaps TO :"consumer_role";
-- Ordered consumer groups (0012): the partition count, members' heartbeats, held events.
GRANT SELECT, INSERT ON :"schema".outbox_consumer_groups TO :"consumer_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".outbox_consumer_members TO :"consumer_role";
GRANT SELECT, INSERT, DELETE ON :"schema".outbox_inbox_held TO :"consumer_role";
-- outbox_group_join re-homes held rows of partitions the group no longer has (0020).
GRANT UPDATE (partition) ON :"schema".outbox_inbox_held TO :"consumer_role";
-- outbox_inbox_attempt counts attempts before they run (0020); outbox_consumer_prune deletes them.
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".outbox_inbox_attempts TO :"consumer_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".outbox_effects TO :"consumer_role";
-- outbox_effect_stray records an item out at a destination beside a row not its own;
-- operators mark one resolved (resolved_at) once they dealt with it.
GRANT SELECT, INSERT, UPDATE (resolved_at) ON :"schema".outbox_effect_strays TO :"consumer_role";
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_budgets TO :"consumer_role";
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_budget_reservations TO :"consumer_role";

---------------------------------------------------------------------------------------------
-- Functions, found by name so that any signature is covered. PUBLIC loses EXECUTE; each
-- role gets its own set. (outbox_wakeup, outbox_record_deleted, outbox_redrive_counter_floor
-- and outbox_number_event are trigger functions: triggers fire whatever the writing role may
-- EXECUTE, so nobody needs them.)

CREATE TEMPORARY TABLE outbox_roles_functions (proname name, grantee text) ON COMMIT DROP;
INSERT INTO outbox_roles_functions VALUES
    ('outbox_claim', :'relay_role'),
    ('outbox_lease', :'relay_role'),
    ('outbox_leave', :'relay_role'),
    ('outbox_record_failures', :'relay_role'),
    ('outbox_redrive', :'relay_role'),
    ('outbox_set_wakeup', :'relay_role'),
    ('outbox_refresh_statistics', :'relay_role'),
    ('outbox_number_due', :'relay_role'),
    ('outbox_claim_keys', :'relay_role'),
    ('outbox_claim_pick', :'relay_role'),
    ('outbox_claim_rows', :'relay_role'),
    ('outbox_message_bytes', :'relay_role'),
    ('outbox_enqueue', :'producer_role'),
    ('outbox_wakeup', NULL),
    ('outbox_record_deleted', NULL),
    ('outbox_inbox_record', :'consumer_role'),
    ('outbox_inbox_gap', :'consumer_role'),
    ('outbox_inbox_dead', :'consumer_role'),
    ('outbox_inbox_attempt', :'consumer_role'),
    ('outbox_group_join', :'consumer_role'),
    ('outbox_group_beat', :'consumer_role'),
    ('outbox_group_leave', :'consumer_role'),
    ('outbox_group_record', :'consumer_role'),
    ('outbox_group_advance', :'consumer_role'),
    ('outbox_group_dead', :'consumer_role'),
    ('outbox_group_releasable', :'consumer_role'),
    ('outbox_group_take_held', :'consumer_role'),
    ('outbox_group_park', :'consumer_role'),
    ('outbox_consumer_release', :'consumer_role'),
    ('outbox_budget_set', :'consumer_role'),
    ('outbox_budget_reserve', :'consumer_role'),
    ('outbox_budget_release', :'consumer_role'),
    ('outbox_budget_consume', :'consumer_role'),
    ('outbox_effect_enqueue', :'consumer_role'),
    ('outbox_effect_claim', :'consumer_role'),
    ('outbox_effect_complete', :'consumer_role'),
    ('outbox_effect_fail', :'consumer_role'),
    ('outbox_effect_retry', :'consumer_role'),
    ('outbox_effect_cancel', :'consumer_role'),
    ('outbox_effect_withdrawn', :'consumer_role'),
    ('outbox_effect_withdraw_failed', :'consumer_role'),
    ('outbox_effect_stray', :'consumer_role'),
    ('outbox_effect_stuck', :'consumer_role'),
    ('outbox_effect_resolve', :'consumer_role'),
    ('outbox_consumer_prune', :'consumer_role');

SELECT format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, %I, %I, %I',
              p.oid::regprocedure, :'relay_role', :'producer_role', :'consumer_role')
  FROM pg_proc p JOIN outbox_roles_functions f ON f.proname = p.proname
 WHERE p.pronamespace = to_regnamespace(:'schema')
 ORDER BY 1
\gexec

SELECT format('GRANT EXECUTE ON FUNCTION %s TO %I', p.oid::regprocedure, f.grantee)
  FROM pg_proc p JOIN outbox_roles_functions f ON f.proname = p.proname
 WHERE p.pronamespace = to_regnamespace(:'schema') AND f.grantee IS NOT NULL
 ORDER BY 1
\gexec

COMMIT;

\echo roles.sql: roles :relay_role (relay), :producer_role (producer), :consumer_role (consumer kit) granted on schema :schema of database :DBNAME
