-- outbox-relay migration 0003: the consumer kit: inbox, per-key applied seq, effects ledger
-- and budgets, with one function per step so a consumer in any language follows the same rules.
--
-- Plain SQL for `search_path = <schema>`, like 0001 and 0002. Every function captures the
-- schema with `SET search_path FROM CURRENT`. Errors a caller must tell apart carry their
-- own SQLSTATE: 'OB001' out of budget (DETAIL is a JSON object with tenant, quota_key,
-- needed and remaining).

-- Inbox: one row per (consumer, event) handled. Inserted in the handler's transaction, so a
-- conflict means the event was already handled (or dead-lettered) by this consumer.
CREATE TABLE outbox_inbox (
    consumer       text NOT NULL,
    event_id       uuid NOT NULL,
    aggregate_type text,
    aggregate_id   text,
    seq            bigint,
    outcome        text NOT NULL DEFAULT 'applied' CHECK (outcome IN ('applied', 'dead')),
    reason         text,
    handled_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX outbox_inbox_handled ON outbox_inbox (handled_at);

-- Ordered apply: the last seq applied per (consumer, key). Never deleted by retention: a
-- key that lost its row would wait for seq 1 again.
CREATE TABLE outbox_inbox_keys (
    consumer       text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    last_seq       bigint NOT NULL DEFAULT 0,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);

-- Gaps given up on after gap_timeout: what was expected, what came, what was done.
CREATE TABLE outbox_inbox_gaps (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer       text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    expected_seq   bigint NOT NULL,
    got_seq        bigint NOT NULL,
    event_id       uuid NOT NULL,
    action         text NOT NULL CHECK (action IN ('skipped', 'dead')),
    reported_at    timestamptz NOT NULL DEFAULT now()
);

-- Effects ledger: one row per side effect outside the database (an email, a payment, a
-- webhook), identified by a caller-chosen key. The state machine:
--   queued -> sending (claim) -> sent (complete) | queued (retry) | failed (fail)
--   queued -> cancelled; sent -> cancelled (after the destination deleted it)
--   sending with cancel_requested_at: the claimer withdraws it once its send returns.
-- `lease_until` is the claimer's promise: it finishes its send and write-back before then,
-- so nobody else touches a row in `sending` until it passed.
CREATE TABLE outbox_effects (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    effect_key          text NOT NULL,
    destination         text NOT NULL,
    payload             jsonb NOT NULL DEFAULT '{}',
    state               text NOT NULL DEFAULT 'queued'
                        CHECK (state IN ('queued', 'sending', 'sent', 'failed', 'cancelled')),
    claimed_by          text,
    claimed_at          timestamptz,
    lease_until         timestamptz,
    external_id         text,
    attempts            integer NOT NULL DEFAULT 0,
    last_error          text,
    -- the last attempt may have reached the destination: look it up before sending again
    uncertain           boolean NOT NULL DEFAULT false,
    cancel_requested_at timestamptz,
    withdrawn_at        timestamptz,
    -- the budget this effect draws on (all NULL: none)
    tenant              text,
    quota_key           text,
    cost                bigint CHECK (cost IS NULL OR cost > 0),
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    sent_at             timestamptz,
    CONSTRAINT outbox_effects_key UNIQUE (effect_key),
    CONSTRAINT outbox_effects_budget_complete
        CHECK ((tenant IS NULL) = (quota_key IS NULL) AND (tenant IS NULL) = (cost IS NULL))
);
CREATE INDEX outbox_effects_sending ON outbox_effects (lease_until) WHERE state = 'sending';
CREATE INDEX outbox_effects_finished ON outbox_effects (updated_at)
    WHERE state IN ('sent', 'failed', 'cancelled');

-- Budgets: what a tenant may still spend per quota key. `remaining` only counts what is
-- neither held nor consumed, so per budget: granted = remaining + held + consumed.
CREATE TABLE outbox_budgets (
    tenant     text NOT NULL,
    quota_key  text NOT NULL,
    remaining  bigint NOT NULL CHECK (remaining >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, quota_key)
);

-- One reservation per effect: held while the effect may still be sent, consumed when it
-- was, released (given back to `remaining`) when it failed for good or was cancelled.
CREATE TABLE outbox_budget_reservations (
    effect_id  bigint PRIMARY KEY REFERENCES outbox_effects (id) ON DELETE CASCADE,
    tenant     text NOT NULL,
    quota_key  text NOT NULL,
    amount     bigint NOT NULL CHECK (amount > 0),
    state      text NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'consumed', 'released')),
    created_at timestamptz NOT NULL DEFAULT now(),
    settled_at timestamptz,
    FOREIGN KEY (tenant, quota_key) REFERENCES outbox_budgets (tenant, quota_key)
);
CREATE INDEX outbox_budget_reservations_budget ON outbox_budget_reservations (tenant, quota_key)
    WHERE state = 'held';

---------------------------------------------------------------------------------------------
-- Inbox functions

-- Call first in the handler's transaction. Returns 'apply' (go on; the event is recorded and,
-- when p_seq is given, the key advanced to it), 'duplicate' (already handled, or older than
-- the key's last applied seq: commit and ack without handling) or 'gap' (an earlier seq of
-- the key is missing: roll back and retry later; expected_seq says which).
-- Pass p_seq NULL for unordered consumers. A concurrent transaction recording the same event
-- or key waits on its lock, so two consumers never both get 'apply'.
CREATE FUNCTION outbox_inbox_record(
    p_consumer text,
    p_event_id uuid,
    p_aggregate_type text,
    p_aggregate_id text,
    p_seq bigint
) RETURNS TABLE (outcome text, expected_seq bigint)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    v_last bigint;
    v_inserted integer;
BEGIN
    IF p_seq IS NOT NULL THEN
        INSERT INTO outbox_inbox_keys (consumer, aggregate_type, aggregate_id)
        VALUES (p_consumer, p_aggregate_type, p_aggregate_id)
        ON CONFLICT DO NOTHING;
        SELECT k.last_seq INTO v_last FROM outbox_inbox_keys k
         WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
           AND k.aggregate_id = p_aggregate_id
           FOR UPDATE;
        IF p_seq <= v_last THEN
            RETURN QUERY SELECT 'duplicate'::text, v_last + 1;
            RETURN;
        ELSIF p_seq > v_last + 1 THEN
            RETURN QUERY SELECT 'gap'::text, v_last + 1;
            RETURN;
        END IF;
    END IF;

    INSERT INTO outbox_inbox (consumer, event_id, aggregate_type, aggregate_id, seq)
    VALUES (p_consumer, p_event_id, p_aggregate_type, p_aggregate_id, p_seq)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS v_inserted = ROW_COUNT;
    IF v_inserted = 0 THEN
        RETURN QUERY SELECT 'duplicate'::text, NULL::bigint;
        RETURN;
    END IF;
    IF p_seq IS NOT NULL THEN
        UPDATE outbox_inbox_keys k SET last_seq = p_seq, updated_at = now()
         WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
           AND k.aggregate_id = p_aggregate_id;
    END IF;
    RETURN QUERY SELECT 'apply'::text, NULL::bigint;
END
$$;

-- Gives up on a gap: records it, and for 'skipped' moves the key to just before p_got_seq so
-- that outbox_inbox_record applies it next. For 'dead' the key stays where it is.
CREATE FUNCTION outbox_inbox_gap(
    p_consumer text,
    p_event_id uuid,
    p_aggregate_type text,
    p_aggregate_id text,
    p_expected_seq bigint,
    p_got_seq bigint,
    p_action text
) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO outbox_inbox_gaps
        (consumer, aggregate_type, aggregate_id, expected_seq, got_seq, event_id, action)
    VALUES (p_consumer, p_aggregate_type, p_aggregate_id, p_expected_seq, p_got_seq, p_event_id, p_action);
    IF p_action = 'skipped' THEN
        UPDATE outbox_inbox_keys k SET last_seq = greatest(k.last_seq, p_got_seq - 1), updated_at = now()
         WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
           AND k.aggregate_id = p_aggregate_id;
    END IF;
END
$$;

-- Records an event given up on (dead-lettered) so later copies are acked as duplicates.
-- p_advance moves the key past it (ordered consumers that skip what they cannot apply).
CREATE FUNCTION outbox_inbox_dead(
    p_consumer text,
    p_event_id uuid,
    p_aggregate_type text,
    p_aggregate_id text,
    p_seq bigint,
    p_reason text,
    p_advance boolean
) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO outbox_inbox (consumer, event_id, aggregate_type, aggregate_id, seq, outcome, reason)
    VALUES (p_consumer, p_event_id, p_aggregate_type, p_aggregate_id, p_seq, 'dead', p_reason)
    ON CONFLICT (consumer, event_id) DO UPDATE SET outcome = 'dead', reason = excluded.reason;
    IF p_advance AND p_seq IS NOT NULL THEN
        INSERT INTO outbox_inbox_keys AS k (consumer, aggregate_type, aggregate_id, last_seq)
        VALUES (p_consumer, p_aggregate_type, p_aggregate_id, p_seq)
        ON CONFLICT (consumer, aggregate_type, aggregate_id)
        DO UPDATE SET last_seq = greatest(k.last_seq, excluded.last_seq), updated_at = now();
    END IF;
END
$$;

---------------------------------------------------------------------------------------------
-- Budget functions

-- Sets a budget's remaining amount (creates it when missing).
CREATE FUNCTION outbox_budget_set(p_tenant text, p_quota_key text, p_remaining bigint)
RETURNS void
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    INSERT INTO outbox_budgets (tenant, quota_key, remaining) VALUES (p_tenant, p_quota_key, p_remaining)
    ON CONFLICT (tenant, quota_key) DO UPDATE SET remaining = excluded.remaining, updated_at = now()
$$;

-- Reserves the effect's cost from its budget, once: a held or consumed reservation is kept
-- as it is (returns false); a released one is taken again. Out of budget raises 'OB001',
-- which aborts the caller's transaction: a claim that needed the reservation rolls back.
CREATE FUNCTION outbox_budget_reserve(p_effect_id bigint) RETURNS boolean
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    e outbox_effects%ROWTYPE;
    v_state text;
    v_remaining bigint;
BEGIN
    SELECT * INTO e FROM outbox_effects WHERE id = p_effect_id;
    IF NOT FOUND OR e.tenant IS NULL THEN
        RETURN false;
    END IF;
    SELECT r.state INTO v_state FROM outbox_budget_reservations r WHERE r.effect_id = p_effect_id
       FOR UPDATE;
    IF v_state IN ('held', 'consumed') THEN
        RETURN false;
    END IF;
    UPDATE outbox_budgets b SET remaining = b.remaining - e.cost, updated_at = now()
     WHERE b.tenant = e.tenant AND b.quota_key = e.quota_key AND b.remaining >= e.cost
    RETURNING b.remaining INTO v_remaining;
    IF NOT FOUND THEN
        SELECT b.remaining INTO v_remaining FROM outbox_budgets b
         WHERE b.tenant = e.tenant AND b.quota_key = e.quota_key;
        RAISE EXCEPTION 'out of budget: tenant % has % of % left and effect % needs %',
                        e.tenant, coalesce(v_remaining, 0), e.quota_key, e.effect_key, e.cost
            USING ERRCODE = 'OB001',
                  DETAIL = jsonb_build_object('tenant', e.tenant, 'quota_key', e.quota_key,
                                              'needed', e.cost, 'remaining', coalesce(v_remaining, 0))::text,
                  HINT = 'raise the budget with outbox_budget_set, or cancel the effect';
    END IF;
    INSERT INTO outbox_budget_reservations AS r (effect_id, tenant, quota_key, amount)
    VALUES (p_effect_id, e.tenant, e.quota_key, e.cost)
    ON CONFLICT (effect_id) DO UPDATE SET state = 'held', amount = excluded.amount,
                                          created_at = now(), settled_at = NULL;
    RETURN true;
END
$$;

-- Gives a held reservation back to its budget (terminal failure, cancel). Returns the
-- amount given back (0 when nothing was held).
CREATE FUNCTION outbox_budget_release(p_effect_id bigint) RETURNS bigint
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    r outbox_budget_reservations%ROWTYPE;
BEGIN
    UPDATE outbox_budget_reservations x SET state = 'released', settled_at = now()
     WHERE x.effect_id = p_effect_id AND x.state = 'held'
    RETURNING * INTO r;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    UPDATE outbox_budgets b SET remaining = b.remaining + r.amount, updated_at = now()
     WHERE b.tenant = r.tenant AND b.quota_key = r.quota_key;
    RETURN r.amount;
END
$$;

-- Turns a held reservation into spending (the effect reached its destination).
CREATE FUNCTION outbox_budget_consume(p_effect_id bigint) RETURNS bigint
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    WITH c AS (
        UPDATE outbox_budget_reservations x SET state = 'consumed', settled_at = now()
         WHERE x.effect_id = p_effect_id AND x.state = 'held'
        RETURNING x.amount)
    SELECT coalesce((SELECT amount FROM c), 0)
$$;

---------------------------------------------------------------------------------------------
-- Effect functions

-- Adds an effect in state queued, once per key (a second call returns the existing row's id
-- and changes nothing). With p_reserve the budget is reserved in the same transaction
-- (out of budget raises 'OB001'); otherwise the claim reserves it.
CREATE FUNCTION outbox_effect_enqueue(
    p_effect_key text,
    p_destination text,
    p_payload jsonb DEFAULT '{}',
    p_tenant text DEFAULT NULL,
    p_quota_key text DEFAULT NULL,
    p_cost bigint DEFAULT NULL,
    p_reserve boolean DEFAULT false
) RETURNS bigint
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO outbox_effects (effect_key, destination, payload, tenant, quota_key, cost)
    VALUES (p_effect_key, p_destination, coalesce(p_payload, '{}'), p_tenant, p_quota_key,
            CASE WHEN p_tenant IS NULL THEN NULL ELSE coalesce(p_cost, 1) END)
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

-- Claims an effect before sending it: one UPDATE queued -> sending by p_worker, with a
-- lease of p_lease_secs. Returns the claimed row, or no row when it was not queued (another
-- worker has it, or it is finished): then do not send. The budget is reserved in the same
-- transaction; out of budget raises 'OB001' and the claim rolls back with it.
CREATE FUNCTION outbox_effect_claim(p_effect_key text, p_worker text, p_lease_secs double precision)
RETURNS TABLE (id bigint, effect_key text, destination text, payload jsonb, attempts integer,
               uncertain boolean, external_id text)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_id bigint;
BEGIN
    UPDATE outbox_effects e
       SET state = 'sending', claimed_by = p_worker, claimed_at = now(),
           lease_until = now() + make_interval(secs => p_lease_secs),
           attempts = e.attempts + 1, updated_at = now()
     WHERE e.effect_key = p_effect_key AND e.state = 'queued'
    RETURNING e.id INTO v_id;
    IF v_id IS NULL THEN
        RETURN;
    END IF;
    PERFORM outbox_budget_reserve(v_id);
    RETURN QUERY SELECT e.id, e.effect_key, e.destination, e.payload, e.attempts, e.uncertain,
                        e.external_id
                   FROM outbox_effects e WHERE e.id = v_id;
END
$$;

-- Writes success back, only while the row is still ours (sending, claimed_by = p_worker) and
-- no cancel was requested; consumes the reservation. Returns 'sent' when written; otherwise
-- the row's state as it is, or 'cancel_requested' (the caller must withdraw its item at the
-- destination: outbox_effect_withdrawn / outbox_effect_withdraw_failed).
CREATE FUNCTION outbox_effect_complete(p_effect_id bigint, p_worker text, p_external_id text)
RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    e outbox_effects%ROWTYPE;
BEGIN
    SELECT * INTO e FROM outbox_effects x WHERE x.id = p_effect_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'missing';
    END IF;
    IF e.state <> 'sending' OR e.claimed_by IS DISTINCT FROM p_worker THEN
        RETURN e.state;
    END IF;
    IF e.cancel_requested_at IS NOT NULL THEN
        UPDATE outbox_effects x SET external_id = p_external_id, updated_at = now()
         WHERE x.id = p_effect_id;
        RETURN 'cancel_requested';
    END IF;
    UPDATE outbox_effects x
       SET state = 'sent', external_id = p_external_id, sent_at = now(), updated_at = now(),
           uncertain = false, last_error = NULL, lease_until = NULL
     WHERE x.id = p_effect_id;
    PERFORM outbox_budget_consume(p_effect_id);
    RETURN 'sent';
END
$$;

-- Marks an effect failed for good and releases its reservation. Never overwrites success:
-- only from queued, or from sending while claimed by p_worker (p_worker NULL: any claimer,
-- for operators and the reconciler). Returns whether the row changed.
CREATE FUNCTION outbox_effect_fail(p_effect_id bigint, p_worker text, p_error text)
RETURNS boolean
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE outbox_effects e
       SET state = 'failed', last_error = p_error, updated_at = now(), lease_until = NULL
     WHERE e.id = p_effect_id
       AND (e.state = 'queued'
            OR (e.state = 'sending' AND (p_worker IS NULL OR e.claimed_by = p_worker)));
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM outbox_budget_release(p_effect_id);
    RETURN true;
END
$$;

-- Gives a claim back after a transient error so the effect can be sent again later; keeps
-- the reservation. p_uncertain says the destination may have received it (a timeout): the
-- next claimer must look it up before sending. Only while still ours. If a cancel was
-- requested meanwhile: nothing went out → 'cancelled' (reservation released); maybe out
-- (uncertain) → stays 'sending' for a lookup (the caller's, or the reconciler's after the
-- lease). Returns the state the row has afterwards ('missing' when there is none).
CREATE FUNCTION outbox_effect_retry(p_effect_id bigint, p_worker text, p_error text, p_uncertain boolean)
RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    e outbox_effects%ROWTYPE;
BEGIN
    SELECT * INTO e FROM outbox_effects x WHERE x.id = p_effect_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'missing';
    END IF;
    IF e.state <> 'sending' OR e.claimed_by IS DISTINCT FROM p_worker THEN
        RETURN e.state;
    END IF;
    IF e.cancel_requested_at IS NOT NULL THEN
        IF p_uncertain OR e.uncertain THEN
            UPDATE outbox_effects x SET last_error = p_error, uncertain = true, updated_at = now()
             WHERE x.id = p_effect_id;
            RETURN 'sending';
        END IF;
        UPDATE outbox_effects x
           SET state = 'cancelled', last_error = p_error, lease_until = NULL, updated_at = now()
         WHERE x.id = p_effect_id;
        PERFORM outbox_budget_release(p_effect_id);
        RETURN 'cancelled';
    END IF;
    UPDATE outbox_effects x
       SET state = 'queued', claimed_by = NULL, lease_until = NULL, last_error = p_error,
           uncertain = x.uncertain OR p_uncertain, updated_at = now()
     WHERE x.id = p_effect_id;
    RETURN 'queued';
END
$$;

-- Step one of a cancel. Returns what the caller must do:
--   'cancelled'  it was queued: now cancelled, reservation released; nothing was sent
--   'withdraw'   it is out (sent, or sending with an external id): delete it at the
--                destination with external_id, then report with outbox_effect_withdrawn
--                or outbox_effect_withdraw_failed; until then it stays as it is
--   'pending'    it is being sent: the claimer withdraws it when its send returns
--   'sent' ... the state it already had when that is final (failed, cancelled) or 'missing'
CREATE FUNCTION outbox_effect_cancel(p_effect_key text)
RETURNS TABLE (action text, effect_id bigint, external_id text)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    e outbox_effects%ROWTYPE;
BEGIN
    SELECT * INTO e FROM outbox_effects x WHERE x.effect_key = p_effect_key FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'missing'::text, NULL::bigint, NULL::text;
        RETURN;
    END IF;
    IF e.state = 'queued' THEN
        UPDATE outbox_effects x SET state = 'cancelled', updated_at = now(),
               cancel_requested_at = now()
         WHERE x.id = e.id;
        PERFORM outbox_budget_release(e.id);
        RETURN QUERY SELECT 'cancelled'::text, e.id, NULL::text;
    ELSIF e.state = 'sent' OR (e.state = 'sending' AND e.external_id IS NOT NULL) THEN
        UPDATE outbox_effects x SET cancel_requested_at = coalesce(x.cancel_requested_at, now()),
               updated_at = now()
         WHERE x.id = e.id;
        RETURN QUERY SELECT 'withdraw'::text, e.id, e.external_id;
    ELSIF e.state = 'sending' THEN
        UPDATE outbox_effects x SET cancel_requested_at = coalesce(x.cancel_requested_at, now()),
               updated_at = now()
         WHERE x.id = e.id;
        RETURN QUERY SELECT 'pending'::text, e.id, NULL::text;
    ELSE
        RETURN QUERY SELECT e.state, e.id, e.external_id;
    END IF;
END
$$;

-- The destination deleted the item: the effect is cancelled (and its reservation, if still
-- held, released; one that was consumed stays consumed: the item did go out).
CREATE FUNCTION outbox_effect_withdrawn(p_effect_id bigint, p_external_id text)
RETURNS boolean
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE outbox_effects e
       SET state = 'cancelled', external_id = coalesce(p_external_id, e.external_id),
           withdrawn_at = now(), updated_at = now(), lease_until = NULL,
           cancel_requested_at = coalesce(e.cancel_requested_at, now())
     WHERE e.id = p_effect_id AND e.state IN ('sending', 'sent');
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM outbox_budget_release(p_effect_id);
    RETURN true;
END
$$;

-- The destination did not delete the item: it is still out. The effect says so: state sent
-- (with the external id), last_error saying the withdraw failed; the reservation is consumed.
CREATE FUNCTION outbox_effect_withdraw_failed(p_effect_id bigint, p_external_id text, p_error text)
RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE outbox_effects e
       SET state = 'sent', external_id = coalesce(p_external_id, e.external_id),
           sent_at = coalesce(e.sent_at, now()), lease_until = NULL,
           last_error = 'cancel requested but the destination did not withdraw it: ' || p_error,
           updated_at = now()
     WHERE e.id = p_effect_id AND e.state IN ('sending', 'sent');
    PERFORM outbox_budget_consume(p_effect_id);
END
$$;

-- Effects left in sending after their lease ran out and at least p_stuck_secs after the
-- claim: the claimer is gone. The reconciler resolves them through the destination's lookup
-- or lists them for review; it never sends them again without knowing.
CREATE FUNCTION outbox_effect_stuck(p_stuck_secs double precision, p_limit integer)
RETURNS TABLE (id bigint, effect_key text, destination text, claimed_by text,
               claimed_at timestamptz, attempts integer, cancel_requested boolean,
               last_error text)
LANGUAGE sql STABLE SET search_path FROM CURRENT
AS $$
    SELECT e.id, e.effect_key, e.destination, e.claimed_by, e.claimed_at, e.attempts,
           e.cancel_requested_at IS NOT NULL, e.last_error
      FROM outbox_effects e
     WHERE e.state = 'sending'
       AND e.lease_until < now()
       AND e.claimed_at < now() - make_interval(secs => p_stuck_secs)
     ORDER BY e.lease_until
     LIMIT p_limit
$$;

-- The reconciler's verdict on a stuck effect, fenced on the claimer it saw (a worker that
-- came back meanwhile wins): 'sent' (the destination has it: consumes the reservation) or
-- 'queued' (the destination does not have it: may be sent again; reservation kept).
CREATE FUNCTION outbox_effect_resolve(p_effect_id bigint, p_seen_worker text, p_state text, p_external_id text)
RETURNS boolean
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_state NOT IN ('sent', 'queued') THEN
        RAISE EXCEPTION 'outbox_effect_resolve: state must be sent or queued, not %', p_state;
    END IF;
    UPDATE outbox_effects e
       SET state = p_state,
           external_id = CASE WHEN p_state = 'sent' THEN p_external_id ELSE e.external_id END,
           sent_at = CASE WHEN p_state = 'sent' THEN now() ELSE e.sent_at END,
           claimed_by = CASE WHEN p_state = 'queued' THEN NULL ELSE e.claimed_by END,
           uncertain = false, lease_until = NULL, updated_at = now(),
           last_error = 'resolved by the reconciler after the claimer ' || e.claimed_by || ' stopped'
     WHERE e.id = p_effect_id AND e.state = 'sending' AND e.claimed_by = p_seen_worker;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_state = 'sent' THEN
        PERFORM outbox_budget_consume(p_effect_id);
    END IF;
    RETURN true;
END
$$;

-- Retention: deletes up to p_limit finished effects (sent, failed, cancelled) last changed
-- before p_before, and up to p_limit inbox rows handled before p_before. Call until both
-- counts come back below p_limit. Never touches outbox_inbox_keys.
CREATE FUNCTION outbox_consumer_prune(p_before timestamptz, p_limit integer)
RETURNS TABLE (effects_deleted bigint, inbox_deleted bigint)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    v_effects bigint;
    v_inbox bigint;
BEGIN
    WITH d AS (
        DELETE FROM outbox_effects e
         WHERE e.id IN (SELECT x.id FROM outbox_effects x
                         WHERE x.state IN ('sent', 'failed', 'cancelled') AND x.updated_at < p_before
                         ORDER BY x.updated_at LIMIT p_limit
                           FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*) INTO v_effects FROM d;
    WITH d AS (
        DELETE FROM outbox_inbox i
         WHERE (i.consumer, i.event_id) IN (
               SELECT x.consumer, x.event_id FROM outbox_inbox x
                WHERE x.handled_at < p_before
                ORDER BY x.handled_at LIMIT p_limit
                  FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*) INTO v_inbox FROM d;
    RETURN QUERY SELECT v_effects, v_inbox;
END
$$;
