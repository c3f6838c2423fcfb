-- Three holes in the effects ledger, and a claim that accepted any lease.
--
-- (a) outbox_effect_complete by a worker that no longer held the claim returned the row's
--     state; when someone else had sent the item meanwhile that was 'sent', and the late
--     worker took it for its own success and left its duplicate out. It now returns
--     'not_ours' for a row that is not this worker's claim, except the one case that is a
--     retry of its own write-back (sent with this very external id), which stays 'sent'.
-- (c) A worker that finds the row not its own must withdraw its item; when that delete
--     failed nothing was written, and the ledger kept saying failed/queued/sent-by-another
--     while a second item was out. outbox_effect_stray records such an item (the row's
--     state is someone else's truth and is left alone); outbox_effect_strays lists them for
--     the reconciler and operators.
-- (b) is the caller's rule (an in-doubt effect whose lookup fails stays in doubt); the Rust
--     Ledger follows it, and the function docs say it for other languages.
--
-- outbox_effect_claim took any lease: one shorter than a send lets the reconciler decide
-- about a live send. It now takes the send and write-back timeouts and refuses a lease not
-- longer than 2 x send + write (a send, a lookup or a withdraw, the write-back), as the
-- Rust EffectsConfig does. The three-argument form is dropped; its grants carry over.

CREATE TABLE outbox_effect_strays (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    effect_id   bigint NOT NULL REFERENCES outbox_effects (id) ON DELETE CASCADE,
    worker      text NOT NULL,
    external_id text NOT NULL,
    error       text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    resolved_at timestamptz
);
CREATE INDEX outbox_effect_strays_open ON outbox_effect_strays (effect_id) WHERE resolved_at IS NULL;

CREATE OR REPLACE FUNCTION outbox_effect_complete(p_effect_id bigint, p_worker text, p_external_id text)
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
    IF e.state = 'sent' AND e.external_id IS NOT DISTINCT FROM p_external_id THEN
        RETURN 'sent'; -- our own write-back, again (its answer was lost)
    END IF;
    IF e.state <> 'sending' OR e.claimed_by IS DISTINCT FROM p_worker THEN
        RETURN 'not_ours';
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

-- A worker's item that is out at the destination although the ledger row is not its own
-- (it found the row not ours and could not delete the item). Returns the stray's id.
CREATE FUNCTION outbox_effect_stray(p_effect_id bigint, p_worker text, p_external_id text, p_error text)
RETURNS bigint
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    INSERT INTO outbox_effect_strays (effect_id, worker, external_id, error)
    VALUES (p_effect_id, p_worker, p_external_id, p_error)
    RETURNING id
$$;

CREATE TEMPORARY TABLE outbox_effect_claim_acl ON COMMIT DROP AS
    SELECT proacl FROM pg_proc
     WHERE oid = 'outbox_effect_claim(text, text, double precision)'::regprocedure;

DROP FUNCTION outbox_effect_claim(text, text, double precision);

CREATE FUNCTION outbox_effect_claim(
    p_effect_key text,
    p_worker text,
    p_lease_secs double precision,
    p_send_timeout_secs double precision,
    p_write_timeout_secs double precision
) RETURNS TABLE (id bigint, effect_key text, destination text, payload jsonb, attempts integer,
                 uncertain boolean, external_id text)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_id bigint;
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

DO $$
DECLARE
    v_acl aclitem[] := (SELECT proacl FROM outbox_effect_claim_acl);
    v_fn  text := 'outbox_effect_claim(text, text, double precision, double precision, double precision)';
    r     record;
BEGIN
    IF v_acl IS NULL THEN
        RETURN;
    END IF;
    EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_fn);
    FOR r IN SELECT DISTINCT a.grantee FROM aclexplode(v_acl) a WHERE a.privilege_type = 'EXECUTE' LOOP
        IF r.grantee = 0 THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', v_fn);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', v_fn, r.grantee::regrole::text);
        END IF;
    END LOOP;
END
$$;
