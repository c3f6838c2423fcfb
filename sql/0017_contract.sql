-- The public contract, kept: a version clients can read, the effects claim's documented
-- three-argument form back, and an outbox_enqueue that writes what the INSERT can write,
-- with an optional idempotency key.
--
-- (a) outbox_contract_version() returns the contract's version: the number of the newest
--     migration that changed what docs/contract.md lists. A client that needs something a
--     version added checks `outbox_contract_version() >= N` (CHANGELOG.md says what each
--     version changed). A later migration that changes the contract replaces this function
--     with its own number.
-- (b) Migration 0010 dropped outbox_effect_claim(key, worker, lease_secs), the form the
--     documentation gave, and clients written against it failed with "function does not
--     exist". It is back as a wrapper over the five-argument form: it claims with its lease
--     and lets the send and the write-back take a quarter of the lease each, so the
--     five-argument form's rule (the lease outlives 2 x send + write) holds for every lease
--     longer than zero. A lease of zero or less, which the old form took and which expired
--     the claim at once, is refused (SQLSTATE 22023) as the five-argument form refuses it.
-- (c) outbox_enqueue takes routing_key, traceparent, tracestate, event_id and
--     idempotency_key, all optional, after the old arguments: calls written for the old
--     function, by position or by name, work unchanged. Two functions whose defaults
--     overlap would make every old call ambiguous, so the old one is dropped and its grants
--     carry over to the new one.
-- (d) An idempotency key, scoped per aggregate_type: outbox_events.idempotency_key with a
--     unique index on (aggregate_type, idempotency_key). An enqueue whose key is taken
--     inserts nothing and returns the event id of the row that holds it; it never raises a
--     unique violation, so the caller's transaction goes on. The key is remembered as long as
--     its row is in the table: once retention (`--retention`) deleted the row, the same key
--     enqueues a new event. The index is partial (rows without a key are not in it), so
--     producers that never pass a key pay nothing for it.

CREATE FUNCTION outbox_contract_version() RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT 17 $$;

---------------------------------------------------------------------------------------------
-- (b) outbox_effect_claim(key, worker, lease_secs)

CREATE FUNCTION outbox_effect_claim(p_effect_key text, p_worker text, p_lease_secs double precision)
RETURNS TABLE (id bigint, effect_key text, destination text, payload jsonb, attempts integer,
               uncertain boolean, external_id text)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_lease_secs IS NULL OR p_lease_secs <= 0 THEN
        RAISE EXCEPTION 'lease of % s is not longer than zero', p_lease_secs
            USING ERRCODE = '22023',
                  HINT = 'give a lease longer than a send and its write-back';
    END IF;
    RETURN QUERY SELECT * FROM outbox_effect_claim(p_effect_key, p_worker, p_lease_secs,
                                                   p_lease_secs / 4, p_lease_secs / 4);
END
$$;

---------------------------------------------------------------------------------------------
-- (c), (d) outbox_enqueue with every producer column and an idempotency key

ALTER TABLE outbox_events ADD COLUMN idempotency_key text;
CREATE UNIQUE INDEX outbox_events_idempotency_key
    ON outbox_events (aggregate_type, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- The insert trigger of 0015 takes the key's next seq before the unique index is checked:
-- an INSERT that ON CONFLICT DO NOTHING then skips would leave its number without an event.
-- So an insert with an idempotency key, once it holds its key's counter, waits for any other
-- transaction inserting the same idempotency key (a transaction-level advisory lock on the
-- aggregate type and key; taken after the counter, so that two producers of one key never
-- wait for each other in opposite orders), then looks for a row that holds the key; if one does, the number goes back (the key's counter row is still
-- this transaction's) and the row is inserted without one, which the unique index then
-- refuses or ON CONFLICT skips. Same body as 0015 otherwise.
DO $do$
BEGIN
    EXECUTE format($f$
CREATE OR REPLACE FUNCTION %1$I.outbox_number_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = %1$I, pg_temp
AS $$
BEGIN
    IF NEW.available_at > NEW.created_at THEN
        -- Scheduled: numbered once due (outbox_number_due). The key gets its counter now,
        -- so that numbering it later never has to wait for a producer creating it.
        NEW.seq := NULL;
        INSERT INTO %1$I.outbox_key_seq (aggregate_type, aggregate_id, last_seq)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 0)
        ON CONFLICT DO NOTHING;
        RETURN NEW;
    END IF;
    INSERT INTO %1$I.outbox_key_seq AS k (aggregate_type, aggregate_id, last_seq)
    VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = k.last_seq + 1
    RETURNING k.last_seq INTO NEW.seq;
    -- Another transaction inserting the same idempotency key: wait for its end (taken
    -- after the key's counter, never before, so that producers who write one key never
    -- wait on each other in two orders).
    IF NEW.idempotency_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(
            hashtextextended(NEW.aggregate_type || chr(31) || NEW.idempotency_key, 17));
    END IF;
    -- An event_id or an idempotency key already stored: this INSERT fails, or is skipped
    -- by ON CONFLICT DO NOTHING, after this trigger. Its number goes back (the key's row is
    -- still ours), so that no number is left without an event.
    IF EXISTS (SELECT 1 FROM %1$I.outbox_events e WHERE e.event_id = NEW.event_id)
       OR (NEW.idempotency_key IS NOT NULL
           AND EXISTS (SELECT 1 FROM %1$I.outbox_events e
                        WHERE e.aggregate_type = NEW.aggregate_type
                          AND e.idempotency_key = NEW.idempotency_key)) THEN
        UPDATE %1$I.outbox_key_seq k SET last_seq = k.last_seq - 1
         WHERE k.aggregate_type = NEW.aggregate_type AND k.aggregate_id = NEW.aggregate_id;
        NEW.seq := NULL;
    END IF;
    RETURN NEW;
END
$$
$f$, current_schema());
END
$do$;

CREATE TEMPORARY TABLE outbox_acl_0017 ON COMMIT DROP AS
    SELECT 'outbox_enqueue(text, text, text, jsonb, jsonb, timestamptz, text, text, text, uuid, text)'::text AS fn,
           proacl
      FROM pg_proc
     WHERE oid = 'outbox_enqueue(text, text, text, jsonb, jsonb, timestamptz)'::regprocedure;

DROP FUNCTION outbox_enqueue(text, text, text, jsonb, jsonb, timestamptz);

CREATE FUNCTION outbox_enqueue(
    aggregate_type  text,
    aggregate_id    text,
    event_type      text,
    payload         jsonb,
    headers         jsonb DEFAULT '{}',
    available_at    timestamptz DEFAULT now(),
    routing_key     text DEFAULT NULL,
    traceparent     text DEFAULT NULL,
    tracestate      text DEFAULT NULL,
    event_id        uuid DEFAULT NULL,
    idempotency_key text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_id uuid;
BEGIN
    -- A second call with a taken key waits here for the first's transaction: when that
    -- commits, nothing is inserted and the lookup below (a new statement, a new snapshot
    -- under READ COMMITTED) finds its row; when it rolls back, this call inserts. Under
    -- REPEATABLE READ or SERIALIZABLE a key taken by a transaction this one cannot see
    -- fails with SQLSTATE 40001: retry the transaction.
    LOOP
        INSERT INTO outbox_events (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   headers, available_at, routing_key, traceparent, tracestate,
                                   idempotency_key)
        VALUES (coalesce($10, outbox_uuid_v7()), $1, $2, $3, $4, coalesce($5, '{}'),
                coalesce($6, now()), $7, $8, $9, $11)
        ON CONFLICT (aggregate_type, idempotency_key) WHERE idempotency_key IS NOT NULL
        DO NOTHING
        RETURNING event_id INTO v_id;
        IF v_id IS NOT NULL THEN
            RETURN v_id;
        END IF;
        SELECT e.event_id INTO v_id FROM outbox_events e
         WHERE e.aggregate_type = $1 AND e.idempotency_key = $11;
        IF v_id IS NOT NULL THEN
            RETURN v_id;
        END IF;
        -- The row holding the key was deleted (retention) between the two statements: the
        -- key is free again, insert.
    END LOOP;
END
$$;

-- Each new function takes the grants of the one it stands for: the new outbox_enqueue the
-- dropped one's, the restored claim form the five-argument one's (roles.sql grants every
-- outbox_enqueue and outbox_effect_claim by name as well).
INSERT INTO outbox_acl_0017
    SELECT 'outbox_effect_claim(text, text, double precision)', proacl FROM pg_proc
     WHERE oid = 'outbox_effect_claim(text, text, double precision, double precision, double precision)'::regprocedure;

DO $$
DECLARE
    a record;
    r record;
BEGIN
    FOR a IN SELECT fn, proacl FROM outbox_acl_0017 WHERE proacl IS NOT NULL LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', a.fn);
        FOR r IN SELECT DISTINCT x.grantee FROM aclexplode(a.proacl) x
                  WHERE x.privilege_type = 'EXECUTE' LOOP
            IF r.grantee = 0 THEN
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', a.fn);
            ELSE
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', a.fn, r.grantee::regrole::text);
            END IF;
        END LOOP;
    END LOOP;
END
$$;
