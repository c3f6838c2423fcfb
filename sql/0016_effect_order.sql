-- A key's effects go out in the order of its events.
--
-- Before this, each effect stood alone: e1 claimed X1 and died (or its handler timed out)
-- before the request left; its redelivery found X1 `sending`, took that for done, and e2's
-- X2 went out while X1 waited for the reconciler, which sent it minutes later, after X2, or
-- (without destinations) never.
--
-- (a) An effect may name an order key (the event's key, say `ticket/42`); effects of one
--     order key go out in the order they were enqueued (by id). `outbox_effect_enqueue`
--     takes it as an eighth argument; the seven-argument form stays and enqueues without one.
-- (b) The claim refuses an effect while an earlier one of its order key is still queued or
--     sending: it raises SQLSTATE 'OB003' (DETAIL a JSON object with effect_key, earlier,
--     state, order_key) and claims nothing. Retry later: the earlier one is resolved by its
--     own claimer, by a take-over (c), by the reconciler, or by an operator's cancel.
-- (c) A claim whose lease ran out can be taken over by a caller that can look the effect up
--     at the destination: `outbox_effect_claim(..., p_take_over => true)` claims a row in
--     `sending` whose lease has passed (and no cancel waits for it), marked uncertain, so
--     the new claimer looks it up before it sends. The lease outlives every call of the
--     claimer it replaces, so that claimer sends nothing more; its write-back finds the row
--     not its own. The five-argument claim is this one without take-over.

ALTER TABLE outbox_effects ADD COLUMN order_key text;

-- The claim's question: is an earlier effect of this order key still unresolved?
CREATE INDEX outbox_effects_order ON outbox_effects (order_key, id)
    WHERE order_key IS NOT NULL AND state IN ('queued', 'sending');

CREATE FUNCTION outbox_effect_enqueue(
    p_effect_key text,
    p_destination text,
    p_payload jsonb,
    p_tenant text,
    p_quota_key text,
    p_cost bigint,
    p_reserve boolean,
    p_order_key text
) RETURNS bigint
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    v_id bigint;
BEGIN
    -- Effects of one order key take their ids in commit order: an enqueue waits for any other
    -- transaction enqueueing under the same order key to end, so a claim never sees a later
    -- effect of the key while an earlier one is still uncommitted.
    IF p_order_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('outbox_effect_order' || chr(31) || p_order_key, 16));
    END IF;
    INSERT INTO outbox_effects (effect_key, destination, payload, tenant, quota_key, cost, order_key)
    VALUES (p_effect_key, p_destination, coalesce(p_payload, '{}'), p_tenant, p_quota_key,
            CASE WHEN p_tenant IS NULL THEN NULL ELSE coalesce(p_cost, 1) END, p_order_key)
    ON CONFLICT (effect_key) DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT id INTO v_id FROM outbox_effects WHERE effect_key = p_effect_key;
        RETURN v_id;
    END IF;
    IF p_reserve THEN
        PERFORM outbox_budget_reserve(v_id);
    END IF;
    RETURN v_id;
END
$$;

-- The seven-argument form: an effect without an order key.
CREATE OR REPLACE FUNCTION outbox_effect_enqueue(
    p_effect_key text,
    p_destination text,
    p_payload jsonb DEFAULT '{}',
    p_tenant text DEFAULT NULL,
    p_quota_key text DEFAULT NULL,
    p_cost bigint DEFAULT NULL,
    p_reserve boolean DEFAULT false
) RETURNS bigint
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    SELECT outbox_effect_enqueue(p_effect_key, p_destination, p_payload, p_tenant, p_quota_key,
                                 p_cost, p_reserve, NULL::text)
$$;

CREATE FUNCTION outbox_effect_claim(
    p_effect_key text,
    p_worker text,
    p_lease_secs double precision,
    p_send_timeout_secs double precision,
    p_write_timeout_secs double precision,
    p_take_over boolean
) RETURNS TABLE (id bigint, effect_key text, destination text, payload jsonb, attempts integer,
                 uncertain boolean, external_id text)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_id bigint;
    v_order text;
    v_earlier text;
    v_earlier_state text;
BEGIN
    IF p_send_timeout_secs IS NULL OR p_write_timeout_secs IS NULL
       OR p_send_timeout_secs <= 0 OR p_write_timeout_secs <= 0 THEN
        RAISE EXCEPTION 'send and write-back timeouts must be longer than zero'
            USING ERRCODE = '22023';
    END IF;
    IF p_lease_secs IS NULL OR p_lease_secs <= 2 * p_send_timeout_secs + p_write_timeout_secs THEN
        RAISE EXCEPTION 'lease of % s is not longer than the work it guards (2 x send timeout + write timeout = % s)',
                        p_lease_secs, 2 * p_send_timeout_secs + p_write_timeout_secs
            USING ERRCODE = '22023',
                  HINT = 'raise the lease or lower the timeouts';
    END IF;
    -- In SET, e.state is the state before the update: a taken-over row is uncertain.
    UPDATE outbox_effects e
       SET state = 'sending', claimed_by = p_worker, claimed_at = now(),
           lease_until = now() + make_interval(secs => p_lease_secs),
           attempts = e.attempts + 1, updated_at = now(),
           uncertain = e.uncertain OR e.state = 'sending'
     WHERE e.effect_key = p_effect_key
       AND (e.state = 'queued'
            OR (coalesce(p_take_over, false) AND e.state = 'sending'
                AND e.lease_until < now() AND e.cancel_requested_at IS NULL))
    RETURNING e.id, e.order_key INTO v_id, v_order;
    IF v_id IS NULL THEN
        RETURN;
    END IF;
    IF v_order IS NOT NULL THEN
        SELECT b.effect_key, b.state INTO v_earlier, v_earlier_state
          FROM outbox_effects b
         WHERE b.order_key = v_order AND b.id < v_id AND b.state IN ('queued', 'sending')
         ORDER BY b.id
         LIMIT 1;
        IF v_earlier IS NOT NULL THEN
            -- Raising undoes the claim above: nothing is claimed.
            RAISE EXCEPTION 'effect % waits for the earlier effect % (%) of order key %',
                            p_effect_key, v_earlier, v_earlier_state, v_order
                USING ERRCODE = 'OB003',
                      DETAIL = json_build_object('effect_key', p_effect_key, 'earlier', v_earlier,
                                                 'state', v_earlier_state, 'order_key', v_order)::text,
                      HINT = 'claim it again once the earlier effect is sent, failed or cancelled';
        END IF;
    END IF;
    PERFORM outbox_budget_reserve(v_id);
    RETURN QUERY SELECT e.id, e.effect_key, e.destination, e.payload, e.attempts, e.uncertain,
                        e.external_id
                   FROM outbox_effects e WHERE e.id = v_id;
END
$$;

-- The five-argument form: a claim of a queued effect only.
CREATE OR REPLACE FUNCTION outbox_effect_claim(
    p_effect_key text,
    p_worker text,
    p_lease_secs double precision,
    p_send_timeout_secs double precision,
    p_write_timeout_secs double precision
) RETURNS TABLE (id bigint, effect_key text, destination text, payload jsonb, attempts integer,
                 uncertain boolean, external_id text)
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    SELECT * FROM outbox_effect_claim(p_effect_key, p_worker, p_lease_secs, p_send_timeout_secs,
                                      p_write_timeout_secs, false)
$$;

-- The new forms are granted to whoever may run the forms they extend (roles.sql grants by
-- name, so a schema set up with it before this migration keeps working without a rerun).
DO $$
DECLARE
    v_pair record;
    r      record;
BEGIN
    FOR v_pair IN
        SELECT 'outbox_effect_enqueue(text, text, jsonb, text, text, bigint, boolean)'::regprocedure AS old_fn,
               'outbox_effect_enqueue(text, text, jsonb, text, text, bigint, boolean, text)' AS new_fn
        UNION ALL
        SELECT 'outbox_effect_claim(text, text, double precision, double precision, double precision)'::regprocedure,
               'outbox_effect_claim(text, text, double precision, double precision, double precision, boolean)'
    LOOP
        CONTINUE WHEN (SELECT proacl FROM pg_proc WHERE oid = v_pair.old_fn) IS NULL;
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_pair.new_fn);
        FOR r IN SELECT DISTINCT a.grantee
                   FROM pg_proc p, aclexplode(p.proacl) a
                  WHERE p.oid = v_pair.old_fn AND a.privilege_type = 'EXECUTE' LOOP
            IF r.grantee = 0 THEN
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', v_pair.new_fn);
            ELSE
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', v_pair.new_fn, r.grantee::regrole::text);
            END IF;
        END LOOP;
    END LOOP;
END
$$;
