-- The schema that the migrations in sql/ build (in schema `public`), in one place to read.
-- Generated, do not edit: after changing a migration run scripts/schema-dump.
-- tests/it/schema_file.rs fails while this file differs from a fresh dump.

--
-- Name: outbox_budget_consume(bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_budget_consume(p_effect_id bigint) RETURNS bigint
    LANGUAGE sql
    SET search_path TO 'public'
    AS $$
    WITH c AS (
        UPDATE outbox_budget_reservations x SET state = 'consumed', settled_at = now()
         WHERE x.effect_id = p_effect_id AND x.state = 'held'
        RETURNING x.amount)
    SELECT coalesce((SELECT amount FROM c), 0)
$$;

--
-- Name: outbox_budget_release(bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_budget_release(p_effect_id bigint) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_budget_reserve(bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_budget_reserve(p_effect_id bigint) RETURNS boolean
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_budget_set(text, text, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_budget_set(p_tenant text, p_quota_key text, p_remaining bigint) RETURNS void
    LANGUAGE sql
    SET search_path TO 'public'
    AS $$
    INSERT INTO outbox_budgets (tenant, quota_key, remaining) VALUES (p_tenant, p_quota_key, p_remaining)
    ON CONFLICT (tenant, quota_key) DO UPDATE SET remaining = excluded.remaining, updated_at = now()
$$;

--
-- Name: outbox_claim(text, bigint, integer, integer, boolean, integer, bigint, text[], text[], bigint, bigint[]); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_claim(p_relay text, p_after bigint, p_limit integer, p_per_key integer, p_block_parked_keys boolean, p_max_message_bytes integer, p_max_bytes bigint, p_key_types text[] DEFAULT '{}'::text[], p_key_ids text[] DEFAULT '{}'::text[], p_before bigint DEFAULT NULL::bigint, p_held bigint[] DEFAULT '{}'::bigint[]) RETURNS TABLE(id bigint, event_id uuid, aggregate_type text, aggregate_id text, event_type text, routing_key text, body text, body_bytes integer, headers text, traceparent text, tracestate text, created_epoch double precision, created_text text, attempts integer, seq bigint, partition integer, scanned_to bigint, scanned integer, per_key integer, next_due double precision, unreadable text)
    LANGUAGE plpgsql
    SET search_path TO 'public'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
DECLARE
    v_owned    integer[];
    v_types    text[] := p_key_types;
    v_ids      text[] := p_key_ids;
    v_keys     record;
    v_pick     record;
    v_per_key  integer;
    v_next_due double precision;
BEGIN
    -- A takeover (outbox_lease) takes this lock exclusively: the partitions read here stay
    -- this relay's until the claim ends.
    PERFORM pg_advisory_xact_lock_shared(outbox_claim_lock_key());

    SELECT array_agg(p.partition) INTO v_owned
      FROM outbox_partitions p
     WHERE p.owner = p_relay AND p.lease_until > clock_timestamp();
    IF v_owned IS NULL THEN
        RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                            NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                            NULL::integer, p_after, 0, 0, NULL::float8, NULL::text;
        RETURN;
    END IF;

    -- Rows without a number are rare (scheduled rows once due, rows written with the
    -- trigger off): one probe of their index says whether to number any.
    IF p_before IS NULL AND EXISTS (
        SELECT 1 FROM outbox_events e
         WHERE e.seq IS NULL AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at <= now()) THEN
        SELECT v_types || coalesce(array_agg(d.aggregate_type), '{}'),
               v_ids || coalesce(array_agg(d.aggregate_id), '{}')
          INTO v_types, v_ids
          FROM outbox_number_due(v_owned, p_limit) d;
    END IF;

    SELECT * INTO v_keys
      FROM outbox_claim_keys(v_owned, p_after, p_before, p_limit, p_block_parked_keys,
                             v_types, v_ids, p_held);
    IF v_keys.scanned >= least(p_limit, 256) THEN
        PERFORM outbox_refresh_statistics(v_keys.scanned);  -- see "Statistics" in 0007
    END IF;

    -- Spread p_limit over the keys waiting: shallow prefixes for many keys, deep for few.
    v_per_key := greatest(1, least(p_per_key,
        ceil(p_limit::numeric / greatest(coalesce(cardinality(v_keys.key_types), 0), 1))::integer));
    SELECT * INTO v_pick
      FROM outbox_claim_pick(v_keys.key_types, v_keys.key_ids, v_keys.first_ids, v_per_key,
                             p_limit, p_held);

    -- When the earliest scheduled row not yet due becomes due (seconds from now), so that
    -- the relay claims then instead of at its next poll. Forward claims only.
    IF p_before IS NULL THEN
        SELECT extract(epoch FROM min(e.available_at) - now())::float8 INTO v_next_due
          FROM outbox_events e
         WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at > e.created_at
           AND e.available_at > now();
    END IF;

    RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                        NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                        NULL::integer,
                        coalesce(v_pick.cut - 1, v_keys.scanned_to, p_after),
                        coalesce(v_keys.scanned, 0), v_per_key, v_next_due, NULL::text;
    RETURN QUERY
    SELECT r.id, r.event_id, r.aggregate_type, r.aggregate_id, r.event_type, r.routing_key,
           r.body, r.body_bytes, r.headers, r.traceparent, r.tracestate, r.created_epoch,
           r.created_text, r.attempts, r.seq, r.partition,
           NULL::bigint, NULL::integer, NULL::integer, NULL::float8, r.unreadable
      FROM outbox_claim_rows(v_pick.ids, p_max_message_bytes, p_max_bytes) r;
END
$$;

--
-- Name: outbox_claim_keys(integer[], bigint, bigint, integer, boolean, text[], text[], bigint[]); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_claim_keys(p_owned integer[], p_after bigint, p_before bigint, p_limit integer, p_block_parked_keys boolean, p_key_types text[], p_key_ids text[], p_held bigint[], OUT scanned_to bigint, OUT scanned integer, OUT key_types text[], OUT key_ids text[], OUT first_ids bigint[]) RETURNS record
    LANGUAGE plpgsql STABLE
    SET search_path TO 'public'
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    AS $$
#variable_conflict use_column
DECLARE
    v_all boolean := cardinality(p_owned) = 64;
BEGIN
    WITH cand AS (
        SELECT e.id, e.aggregate_type, e.aggregate_id
          FROM outbox_events e
         WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at <= e.created_at
           AND e.id > p_after
           AND (p_before IS NULL OR e.id <= p_before)
           AND NOT (e.id = ANY (p_held))
           AND (v_all OR outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (p_owned))
         ORDER BY e.id
         LIMIT p_limit
    ), due AS (
        -- Scheduled rows that are due, earliest first, for forward claims only, for at
        -- most half the claim; keys that stay blocked are left out here, so they cannot
        -- fill this half claim after claim.
        SELECT e.aggregate_type, e.aggregate_id
          FROM outbox_events e
         WHERE p_before IS NULL
           AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at > e.created_at
           AND e.available_at <= now()
           AND NOT (e.id = ANY (p_held))
           AND (v_all OR outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (p_owned))
           AND NOT EXISTS (SELECT 1 FROM outbox_events x
                            WHERE p_block_parked_keys
                              AND x.aggregate_type = e.aggregate_type
                              AND x.aggregate_id = e.aggregate_id
                              AND x.parked_at IS NOT NULL)
         ORDER BY e.available_at, e.id
         LIMIT greatest(p_limit / 2, 1)
    ), keys AS (
        SELECT u.aggregate_type, u.aggregate_id, min(u.first_id) AS first_id
          FROM (SELECT c.aggregate_type, c.aggregate_id, c.id AS first_id FROM cand c
                UNION ALL
                SELECT n.aggregate_type, n.aggregate_id, 0::bigint
                  FROM unnest(p_key_types, p_key_ids) AS n(aggregate_type, aggregate_id)
                 WHERE v_all OR outbox_partition_of(n.aggregate_type, n.aggregate_id) = ANY (p_owned)
                UNION ALL
                SELECT d.aggregate_type, d.aggregate_id, 0::bigint FROM due d) u
         GROUP BY u.aggregate_type, u.aggregate_id
    )
    SELECT (SELECT max(c.id) FROM cand c),
           (SELECT count(*) FROM cand c),
           array_agg(k.aggregate_type ORDER BY k.first_id),
           array_agg(k.aggregate_id ORDER BY k.first_id),
           array_agg(k.first_id ORDER BY k.first_id)
      INTO scanned_to, scanned, key_types, key_ids, first_ids
      FROM keys k
     WHERE NOT EXISTS (SELECT 1 FROM outbox_events x
                        WHERE p_block_parked_keys
                          AND x.aggregate_type = k.aggregate_type
                          AND x.aggregate_id = k.aggregate_id
                          AND x.parked_at IS NOT NULL);
END
$$;

--
-- Name: outbox_claim_lock_key(); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_claim_lock_key() RETURNS bigint
    LANGUAGE sql STABLE
    SET search_path TO 'public'
    AS $$ SELECT hashtextextended('outbox-relay:claim:' || current_schema(), 0) $$;

--
-- Name: outbox_claim_pick(text[], text[], bigint[], integer, integer, bigint[]); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_claim_pick(p_key_types text[], p_key_ids text[], p_first_ids bigint[], p_per_key integer, p_limit integer, p_held bigint[], OUT ids bigint[], OUT cut bigint) RETURNS record
    LANGUAGE plpgsql STABLE
    SET search_path TO 'public'
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    AS $$
#variable_conflict use_column
BEGIN
    WITH q AS (
        SELECT k.ord, k.first_id, x.id, x.seq
          FROM unnest(p_key_types, p_key_ids, p_first_ids) WITH ORDINALITY AS k(aggregate_type, aggregate_id, first_id, ord)
         CROSS JOIN LATERAL (
               SELECT e.id, e.seq
                 FROM outbox_events e
                WHERE e.aggregate_type = k.aggregate_type
                  AND e.aggregate_id = k.aggregate_id
                  AND e.dispatched_at IS NULL AND e.parked_at IS NULL
                  AND e.seq IS NOT NULL
                  AND NOT (e.id = ANY (p_held))
                ORDER BY e.seq
                LIMIT p_per_key) x
    ), n AS (
        SELECT q.*, row_number() OVER (ORDER BY q.ord, q.seq) AS n FROM q
    )
    SELECT array_agg(n.id ORDER BY n.n) FILTER (WHERE n.n <= p_limit),
           min(n.first_id) FILTER (WHERE n.n > p_limit AND n.first_id > 0)
      INTO ids, cut
      FROM n;
END
$$;

--
-- Name: outbox_claim_rows(bigint[], integer, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_claim_rows(p_ids bigint[], p_max_message_bytes integer, p_max_bytes bigint) RETURNS TABLE(id bigint, event_id uuid, aggregate_type text, aggregate_id text, event_type text, routing_key text, body text, body_bytes integer, headers text, traceparent text, tracestate text, created_epoch double precision, created_text text, attempts integer, seq bigint, partition integer, unreadable text)
    LANGUAGE plpgsql STABLE
    SET search_path TO 'public'
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    AS $$
#variable_conflict use_column
DECLARE
    v_check boolean := current_setting('server_encoding') = 'SQL_ASCII';
BEGIN
    RETURN QUERY
    WITH r AS MATERIALIZED (
        SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type,
               coalesce(e.routing_key, e.aggregate_type || '.' || e.event_type) AS routing_key,
               e.payload::text AS body, e.headers::text AS headers, e.traceparent, e.tracestate,
               extract(epoch FROM e.created_at)::float8 AS created_epoch,
               to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS created_text,
               e.attempts, e.seq,
               outbox_partition_of(e.aggregate_type, e.aggregate_id) AS partition,
               p.ord
          FROM unnest(p_ids) WITH ORDINALITY AS p(id, ord)
          JOIN outbox_events e ON e.id = p.id
    ), checked AS (
        SELECT r.*,
               CASE WHEN v_check THEN
                   nullif(concat_ws(', ',
                       CASE WHEN NOT outbox_utf8_valid(r.aggregate_type) THEN 'aggregate_type' END,
                       CASE WHEN NOT outbox_utf8_valid(r.aggregate_id) THEN 'aggregate_id' END,
                       CASE WHEN NOT outbox_utf8_valid(r.event_type) THEN 'event_type' END,
                       CASE WHEN NOT outbox_utf8_valid(r.routing_key) THEN 'routing_key' END,
                       CASE WHEN NOT outbox_utf8_valid(r.body) THEN 'payload' END,
                       CASE WHEN NOT outbox_utf8_valid(r.headers) THEN 'headers' END,
                       CASE WHEN NOT outbox_utf8_valid(r.traceparent) THEN 'traceparent' END,
                       CASE WHEN NOT outbox_utf8_valid(r.tracestate) THEN 'tracestate' END), '')
               END AS bad
          FROM r
    ), measured AS (
        SELECT r.*,
               octet_length(r.aggregate_type) + octet_length(r.aggregate_id)
                 + octet_length(r.event_type) + octet_length(r.routing_key) AS key_bytes,
               outbox_message_bytes(r.aggregate_type, r.aggregate_id, r.event_type, r.routing_key,
                                    r.body, r.headers, r.traceparent, r.tracestate) AS message_bytes
          FROM checked r
    ), sized AS (
        SELECT m.*, m.message_bytes > p_max_message_bytes OR m.bad IS NOT NULL AS oversized,
               sum(CASE WHEN m.message_bytes > p_max_message_bytes OR m.bad IS NOT NULL THEN m.key_bytes
                        ELSE m.message_bytes END) OVER (ORDER BY m.ord) AS running
          FROM measured m
    )
    SELECT s.id, s.event_id,
           CASE WHEN s.bad IS NULL THEN s.aggregate_type ELSE encode(convert_to(s.aggregate_type, 'SQL_ASCII'), 'hex') END,
           CASE WHEN s.bad IS NULL THEN s.aggregate_id ELSE encode(convert_to(s.aggregate_id, 'SQL_ASCII'), 'hex') END,
           CASE WHEN s.bad IS NULL THEN s.event_type ELSE '' END,
           CASE WHEN s.bad IS NULL THEN s.routing_key ELSE '' END,
           CASE WHEN s.oversized THEN NULL ELSE s.body END,
           s.message_bytes,
           CASE WHEN s.oversized THEN NULL ELSE s.headers END,
           CASE WHEN s.oversized THEN NULL ELSE s.traceparent END,
           CASE WHEN s.oversized THEN NULL ELSE s.tracestate END,
           s.created_epoch, s.created_text, s.attempts, s.seq, s.partition,
           CASE WHEN s.bad IS NOT NULL THEN 'unreadable row: ' || s.bad || ' not valid UTF-8' END
      FROM sized s
     WHERE s.ord = 1 OR s.running <= p_max_bytes
     ORDER BY s.ord;
END
$$;

--
-- Name: outbox_consumer_prune(timestamp with time zone, integer); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_consumer_prune(p_before timestamp with time zone, p_limit integer) RETURNS TABLE(effects_deleted bigint, inbox_deleted bigint)
    LANGUAGE plpgsql
    SET search_path TO 'public'
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
    DELETE FROM outbox_inbox_attempts a
     WHERE (a.consumer, a.event_id) IN (
           SELECT x.consumer, x.event_id FROM outbox_inbox_attempts x
            WHERE x.last_at < p_before
            LIMIT p_limit
              FOR UPDATE SKIP LOCKED);
    RETURN QUERY SELECT v_effects, v_inbox;
END
$$;

--
-- Name: outbox_consumer_release(text, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_consumer_release(p_consumer text, p_aggregate_type text, p_aggregate_id text) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
DECLARE
    v_blocked bigint;
BEGIN
    SELECT k.blocked_seq INTO v_blocked FROM outbox_inbox_keys k
     WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
       AND k.aggregate_id = p_aggregate_id
       FOR UPDATE;
    IF v_blocked IS NULL THEN
        RETURN NULL;
    END IF;
    UPDATE outbox_inbox_keys k SET blocked_seq = NULL, blocked_at = NULL, blocked_reason = NULL,
                                   updated_at = now()
     WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
       AND k.aggregate_id = p_aggregate_id;
    RETURN (SELECT count(*) FROM outbox_inbox_held h
             WHERE h.consumer = p_consumer AND h.aggregate_type = p_aggregate_type
               AND h.aggregate_id = p_aggregate_id);
END
$$;

--
-- Name: outbox_contract_version(); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_contract_version() RETURNS integer
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT 20 $$;

--
-- Name: outbox_effect_cancel(text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_cancel(p_effect_key text) RETURNS TABLE(action text, effect_id bigint, external_id text)
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_claim(text, text, double precision); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_claim(p_effect_key text, p_worker text, p_lease_secs double precision) RETURNS TABLE(id bigint, effect_key text, destination text, payload jsonb, attempts integer, uncertain boolean, external_id text)
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_claim(text, text, double precision, double precision, double precision); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_claim(p_effect_key text, p_worker text, p_lease_secs double precision, p_send_timeout_secs double precision, p_write_timeout_secs double precision) RETURNS TABLE(id bigint, effect_key text, destination text, payload jsonb, attempts integer, uncertain boolean, external_id text)
    LANGUAGE sql
    SET search_path TO 'public'
    AS $$
    SELECT * FROM outbox_effect_claim(p_effect_key, p_worker, p_lease_secs, p_send_timeout_secs,
                                      p_write_timeout_secs, false)
$$;

--
-- Name: outbox_effect_claim(text, text, double precision, double precision, double precision, boolean); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_claim(p_effect_key text, p_worker text, p_lease_secs double precision, p_send_timeout_secs double precision, p_write_timeout_secs double precision, p_take_over boolean) RETURNS TABLE(id bigint, effect_key text, destination text, payload jsonb, attempts integer, uncertain boolean, external_id text)
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_complete(bigint, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_complete(p_effect_id bigint, p_worker text, p_external_id text) RETURNS text
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_enqueue(text, text, jsonb, text, text, bigint, boolean); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_enqueue(p_effect_key text, p_destination text, p_payload jsonb DEFAULT '{}'::jsonb, p_tenant text DEFAULT NULL::text, p_quota_key text DEFAULT NULL::text, p_cost bigint DEFAULT NULL::bigint, p_reserve boolean DEFAULT false) RETURNS bigint
    LANGUAGE sql
    SET search_path TO 'public'
    AS $$
    SELECT outbox_effect_enqueue(p_effect_key, p_destination, p_payload, p_tenant, p_quota_key,
                                 p_cost, p_reserve, NULL::text)
$$;

--
-- Name: outbox_effect_enqueue(text, text, jsonb, text, text, bigint, boolean, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_enqueue(p_effect_key text, p_destination text, p_payload jsonb, p_tenant text, p_quota_key text, p_cost bigint, p_reserve boolean, p_order_key text) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_fail(bigint, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_fail(p_effect_id bigint, p_worker text, p_error text) RETURNS boolean
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_resolve(bigint, text, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_resolve(p_effect_id bigint, p_seen_worker text, p_state text, p_external_id text) RETURNS boolean
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_retry(bigint, text, text, boolean); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_retry(p_effect_id bigint, p_worker text, p_error text, p_uncertain boolean) RETURNS text
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_stray(bigint, text, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_stray(p_effect_id bigint, p_worker text, p_external_id text, p_error text) RETURNS bigint
    LANGUAGE sql
    SET search_path TO 'public'
    AS $$
    INSERT INTO outbox_effect_strays (effect_id, worker, external_id, error)
    VALUES (p_effect_id, p_worker, p_external_id, p_error)
    RETURNING id
$$;

--
-- Name: outbox_effect_stuck(double precision, integer); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_stuck(p_stuck_secs double precision, p_limit integer) RETURNS TABLE(id bigint, effect_key text, destination text, claimed_by text, claimed_at timestamp with time zone, attempts integer, cancel_requested boolean, last_error text)
    LANGUAGE sql STABLE
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_withdraw_failed(bigint, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_withdraw_failed(p_effect_id bigint, p_external_id text, p_error text) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_effect_withdrawn(bigint, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_effect_withdrawn(p_effect_id bigint, p_external_id text) RETURNS boolean
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_enqueue(text, text, text, jsonb, jsonb, timestamp with time zone, text, text, text, uuid, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_enqueue(aggregate_type text, aggregate_id text, event_type text, payload jsonb, headers jsonb DEFAULT '{}'::jsonb, available_at timestamp with time zone DEFAULT now(), routing_key text DEFAULT NULL::text, traceparent text DEFAULT NULL::text, tracestate text DEFAULT NULL::text, event_id uuid DEFAULT NULL::uuid, idempotency_key text DEFAULT NULL::text) RETURNS uuid
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $_$
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
$_$;

--
-- Name: outbox_group_advance(text, uuid, text, text, bigint, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_advance(p_consumer text, p_event_id uuid, p_aggregate_type text, p_aggregate_id text, p_seq bigint, p_last bigint) RETURNS text
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
BEGIN
    INSERT INTO outbox_inbox (consumer, event_id, aggregate_type, aggregate_id, seq)
    VALUES (p_consumer, p_event_id, p_aggregate_type, p_aggregate_id, p_seq);
    UPDATE outbox_inbox_keys ik SET last_seq = p_seq, updated_at = now()
     WHERE ik.consumer = p_consumer AND ik.aggregate_type = p_aggregate_type
       AND ik.aggregate_id = p_aggregate_id;
    IF p_seq > p_last + 1 THEN
        INSERT INTO outbox_inbox_gaps
            (consumer, aggregate_type, aggregate_id, expected_seq, got_seq, event_id, action)
        VALUES (p_consumer, p_aggregate_type, p_aggregate_id, p_last + 1, p_seq, p_event_id, 'jumped');
        RETURN 'jumped';
    END IF;
    RETURN 'apply';
END
$$;

--
-- Name: outbox_group_beat(text, text, integer); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_beat(p_consumer text, p_member text, p_lease_ms integer) RETURNS SETOF text
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
BEGIN
    DELETE FROM outbox_consumer_members m
     WHERE m.consumer = p_consumer AND m.lease_until < clock_timestamp();
    INSERT INTO outbox_consumer_members AS m (consumer, member, lease_until)
    VALUES (p_consumer, p_member, clock_timestamp() + make_interval(secs => p_lease_ms / 1000.0))
    ON CONFLICT (consumer, member) DO UPDATE SET lease_until = excluded.lease_until;
    RETURN QUERY SELECT m.member FROM outbox_consumer_members m
                  WHERE m.consumer = p_consumer ORDER BY m.member COLLATE "C";
END
$$;

--
-- Name: outbox_group_dead(text, uuid, text, text, bigint, text, boolean); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_dead(p_consumer text, p_event_id uuid, p_aggregate_type text, p_aggregate_id text, p_seq bigint, p_reason text, p_block boolean) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
BEGIN
    INSERT INTO outbox_inbox (consumer, event_id, aggregate_type, aggregate_id, seq, outcome, reason)
    VALUES (p_consumer, p_event_id, p_aggregate_type, p_aggregate_id, p_seq, 'dead', p_reason)
    ON CONFLICT (consumer, event_id) DO UPDATE SET outcome = 'dead', reason = excluded.reason;
    INSERT INTO outbox_inbox_keys AS k (consumer, aggregate_type, aggregate_id, last_seq)
    VALUES (p_consumer, p_aggregate_type, p_aggregate_id, coalesce(p_seq, 0))
    ON CONFLICT (consumer, aggregate_type, aggregate_id)
    DO UPDATE SET last_seq = greatest(k.last_seq, excluded.last_seq), updated_at = now();
    DELETE FROM outbox_inbox_held h
     WHERE h.consumer = p_consumer AND h.aggregate_type = p_aggregate_type
       AND h.aggregate_id = p_aggregate_id AND h.seq = p_seq;
    IF p_block THEN
        UPDATE outbox_inbox_keys k
           SET blocked_seq = coalesce(p_seq, k.last_seq + 1), blocked_at = now(),
               blocked_reason = p_reason
         WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
           AND k.aggregate_id = p_aggregate_id;
    END IF;
END
$$;

--
-- Name: outbox_group_join(text, integer); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_join(p_consumer text, p_partitions integer) RETURNS integer
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
DECLARE
    v_recorded integer;
BEGIN
    INSERT INTO outbox_consumer_groups (consumer, partitions) VALUES (p_consumer, p_partitions)
    ON CONFLICT DO NOTHING;
    SELECT g.partitions INTO v_recorded FROM outbox_consumer_groups g WHERE g.consumer = p_consumer;
    IF v_recorded <> p_partitions THEN
        RAISE EXCEPTION 'consumer group % has % partitions, not %: changing the count maps keys to other partitions while their earlier events still wait in the old ones, so two consumers would apply one key at once; drain the group and delete its row in outbox_consumer_groups first (docs/consumer-kit.md, "Changing the partition count")',
                        p_consumer, v_recorded, p_partitions
            USING ERRCODE = 'OB002',
                  DETAIL = jsonb_build_object('consumer', p_consumer, 'recorded', v_recorded,
                                              'asked', p_partitions)::text;
    END IF;
    -- Only when there is something to move: a role that roles.sql of an earlier version
    -- granted no UPDATE on outbox_inbox_held still joins.
    IF EXISTS (SELECT 1 FROM outbox_inbox_held h
                WHERE h.consumer = p_consumer AND h.partition >= v_recorded) THEN
        UPDATE outbox_inbox_held h SET partition = h.partition % v_recorded
         WHERE h.consumer = p_consumer AND h.partition >= v_recorded;
    END IF;
    RETURN v_recorded;
END
$$;

--
-- Name: outbox_group_leave(text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_leave(p_consumer text, p_member text) RETURNS void
    LANGUAGE sql
    SET search_path TO 'public'
    AS $$
    DELETE FROM outbox_consumer_members WHERE consumer = p_consumer AND member = p_member
$$;

--
-- Name: outbox_group_park(text, integer, uuid, text, text, bigint, text, text, jsonb, bytea, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_park(p_consumer text, p_partition integer, p_event_id uuid, p_aggregate_type text, p_aggregate_id text, p_seq bigint, p_event_type text, p_routing_key text, p_headers jsonb, p_body bytea, p_after bigint) RETURNS text
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
DECLARE
    k outbox_inbox_keys%ROWTYPE;
BEGIN
    IF p_seq IS NULL OR p_after IS NULL OR p_seq <= p_after THEN
        RAISE EXCEPTION 'a parked event''s seq (%) must be above the seq it waits for (%)', p_seq, p_after
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO outbox_inbox_keys (consumer, aggregate_type, aggregate_id)
    VALUES (p_consumer, p_aggregate_type, p_aggregate_id)
    ON CONFLICT DO NOTHING;
    SELECT * INTO k FROM outbox_inbox_keys ik
     WHERE ik.consumer = p_consumer AND ik.aggregate_type = p_aggregate_type
       AND ik.aggregate_id = p_aggregate_id
       FOR UPDATE;
    IF p_seq <= k.last_seq OR EXISTS (
        SELECT 1 FROM outbox_inbox i WHERE i.consumer = p_consumer AND i.event_id = p_event_id
    ) THEN
        RETURN (SELECT r.outcome FROM outbox_group_record(p_consumer, p_partition, p_event_id,
                    p_aggregate_type, p_aggregate_id, p_seq, p_event_type, p_routing_key,
                    p_headers, p_body) r);
    END IF;
    INSERT INTO outbox_inbox_held (consumer, partition, aggregate_type, aggregate_id, seq,
                                   event_id, event_type, routing_key, headers, body, parked_after)
    VALUES (p_consumer, p_partition, p_aggregate_type, p_aggregate_id, p_seq,
            p_event_id, p_event_type, p_routing_key, coalesce(p_headers, '{}'), p_body, p_after)
    ON CONFLICT DO NOTHING;
    RETURN 'parked';
END
$$;

--
-- Name: outbox_group_record(text, integer, uuid, text, text, bigint, text, text, jsonb, bytea); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_record(p_consumer text, p_partition integer, p_event_id uuid, p_aggregate_type text, p_aggregate_id text, p_seq bigint, p_event_type text, p_routing_key text, p_headers jsonb, p_body bytea) RETURNS TABLE(outcome text, last_seq bigint)
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
DECLARE
    k outbox_inbox_keys%ROWTYPE;
BEGIN
    IF p_seq IS NULL OR p_seq < 1 THEN
        RAISE EXCEPTION 'an ordered consumer group needs the event''s seq (x-outbox-seq), got %', p_seq
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO outbox_inbox_keys (consumer, aggregate_type, aggregate_id)
    VALUES (p_consumer, p_aggregate_type, p_aggregate_id)
    ON CONFLICT DO NOTHING;
    SELECT * INTO k FROM outbox_inbox_keys ik
     WHERE ik.consumer = p_consumer AND ik.aggregate_type = p_aggregate_type
       AND ik.aggregate_id = p_aggregate_id
       FOR UPDATE;
    IF EXISTS (
        SELECT 1 FROM outbox_inbox i WHERE i.consumer = p_consumer AND i.event_id = p_event_id
    ) THEN
        RETURN QUERY SELECT 'duplicate'::text, k.last_seq;
        RETURN;
    END IF;
    IF p_seq <= k.last_seq THEN
        -- Older than the key but never seen: it came after a later event of its key, so it
        -- cannot be applied in order. Recorded (once per event), never silently dropped.
        INSERT INTO outbox_inbox_gaps
            (consumer, aggregate_type, aggregate_id, expected_seq, got_seq, event_id, action)
        SELECT p_consumer, p_aggregate_type, p_aggregate_id, k.last_seq + 1, p_seq, p_event_id, 'late'
         WHERE NOT EXISTS (SELECT 1 FROM outbox_inbox_gaps g
                            WHERE g.consumer = p_consumer AND g.event_id = p_event_id
                              AND g.action = 'late');
        RETURN QUERY SELECT 'duplicate'::text, k.last_seq;
        RETURN;
    END IF;
    -- Held: the key is blocked, or has a held event with a lower seq to wait behind. An
    -- event below every held one was still unacked when its key's later events were parked:
    -- it goes before them.
    IF k.blocked_seq IS NOT NULL OR EXISTS (
        SELECT 1 FROM outbox_inbox_held h
         WHERE h.consumer = p_consumer AND h.aggregate_type = p_aggregate_type
           AND h.aggregate_id = p_aggregate_id AND h.seq < p_seq
    ) THEN
        INSERT INTO outbox_inbox_held (consumer, partition, aggregate_type, aggregate_id, seq,
                                       event_id, event_type, routing_key, headers, body)
        VALUES (p_consumer, p_partition, p_aggregate_type, p_aggregate_id, p_seq,
                p_event_id, p_event_type, p_routing_key, coalesce(p_headers, '{}'), p_body)
        ON CONFLICT DO NOTHING;
        RETURN QUERY SELECT 'held'::text, k.last_seq;
        RETURN;
    END IF;
    RETURN QUERY SELECT outbox_group_advance(p_consumer, p_event_id, p_aggregate_type,
                                             p_aggregate_id, p_seq, k.last_seq), k.last_seq;
END
$$;

--
-- Name: outbox_group_releasable(text, integer[]); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_releasable(p_consumer text, p_partitions integer[]) RETURNS TABLE(aggregate_type text, aggregate_id text)
    LANGUAGE sql STABLE
    SET search_path TO 'public'
    AS $$
    SELECT DISTINCT h.aggregate_type, h.aggregate_id
      FROM outbox_inbox_held h
      JOIN outbox_inbox_keys k ON k.consumer = h.consumer
       AND k.aggregate_type = h.aggregate_type AND k.aggregate_id = h.aggregate_id
     WHERE h.consumer = p_consumer AND h.partition = ANY (p_partitions)
       AND k.blocked_seq IS NULL
       AND (h.parked_after IS NULL OR k.last_seq >= h.parked_after)
       AND NOT EXISTS (SELECT 1 FROM outbox_inbox_held e
                        WHERE e.consumer = h.consumer AND e.aggregate_type = h.aggregate_type
                          AND e.aggregate_id = h.aggregate_id AND e.seq < h.seq)
$$;

--
-- Name: outbox_group_take_held(text, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_group_take_held(p_consumer text, p_aggregate_type text, p_aggregate_id text) RETURNS TABLE(outcome text, event_id uuid, seq bigint, event_type text, routing_key text, headers jsonb, body bytea, partition integer)
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
DECLARE
    k outbox_inbox_keys%ROWTYPE;
    h outbox_inbox_held%ROWTYPE;
    v_outcome text;
BEGIN
    SELECT * INTO k FROM outbox_inbox_keys ik
     WHERE ik.consumer = p_consumer AND ik.aggregate_type = p_aggregate_type
       AND ik.aggregate_id = p_aggregate_id
       FOR UPDATE;
    IF NOT FOUND OR k.blocked_seq IS NOT NULL THEN
        RETURN;
    END IF;
    SELECT * INTO h FROM outbox_inbox_held hh
     WHERE hh.consumer = p_consumer AND hh.aggregate_type = p_aggregate_type
       AND hh.aggregate_id = p_aggregate_id
     ORDER BY hh.seq LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF h.parked_after IS NOT NULL AND k.last_seq < h.parked_after THEN
        RETURN;
    END IF;
    DELETE FROM outbox_inbox_held hh
     WHERE hh.consumer = p_consumer AND hh.aggregate_type = p_aggregate_type
       AND hh.aggregate_id = p_aggregate_id AND hh.seq = h.seq;
    IF EXISTS (
        SELECT 1 FROM outbox_inbox i WHERE i.consumer = p_consumer AND i.event_id = h.event_id
    ) THEN
        v_outcome := 'duplicate';
    ELSIF h.seq <= k.last_seq THEN
        -- Held, and its key went past it meanwhile (a later event dead-lettered with
        -- continue, or applied): never seen, so recorded as late, as outbox_group_record
        -- records such an event (0014), never dropped silently.
        INSERT INTO outbox_inbox_gaps
            (consumer, aggregate_type, aggregate_id, expected_seq, got_seq, event_id, action)
        SELECT p_consumer, p_aggregate_type, p_aggregate_id, k.last_seq + 1, h.seq, h.event_id, 'late'
         WHERE NOT EXISTS (SELECT 1 FROM outbox_inbox_gaps g
                            WHERE g.consumer = p_consumer AND g.event_id = h.event_id
                              AND g.action = 'late');
        v_outcome := 'duplicate';
    ELSE
        v_outcome := outbox_group_advance(p_consumer, h.event_id, p_aggregate_type,
                                          p_aggregate_id, h.seq, k.last_seq);
    END IF;
    RETURN QUERY SELECT v_outcome, h.event_id, h.seq, h.event_type, h.routing_key, h.headers,
                        h.body, h.partition;
END
$$;

--
-- Name: outbox_headers_allowed(jsonb); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_headers_allowed(h jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT jsonb_typeof(h) = 'object'
       AND NOT EXISTS (
            SELECT 1 FROM jsonb_object_keys(h) AS k
             WHERE upper(k) IN ('CC', 'BCC')
                OR lower(k) LIKE 'x-outbox-%'
                OR lower(k) IN ('traceparent', 'tracestate')
                OR octet_length(k) > 255
                OR k = '')
$$;

--
-- Name: outbox_inbox_attempt(text, uuid); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_inbox_attempt(p_consumer text, p_event_id uuid) RETURNS integer
    LANGUAGE sql
    SET search_path TO 'public'
    AS $$
    INSERT INTO outbox_inbox_attempts AS a (consumer, event_id) VALUES (p_consumer, p_event_id)
    ON CONFLICT (consumer, event_id) DO UPDATE SET attempts = a.attempts + 1, last_at = now()
    RETURNING a.attempts
$$;

--
-- Name: outbox_inbox_dead(text, uuid, text, text, bigint, text, boolean); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_inbox_dead(p_consumer text, p_event_id uuid, p_aggregate_type text, p_aggregate_id text, p_seq bigint, p_reason text, p_advance boolean) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_inbox_gap(text, uuid, text, text, bigint, bigint, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_inbox_gap(p_consumer text, p_event_id uuid, p_aggregate_type text, p_aggregate_id text, p_expected_seq bigint, p_got_seq bigint, p_action text) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_inbox_record(text, uuid, text, text, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_inbox_record(p_consumer text, p_event_id uuid, p_aggregate_type text, p_aggregate_id text, p_seq bigint) RETURNS TABLE(outcome text, expected_seq bigint)
    LANGUAGE plpgsql
    SET search_path TO 'public'
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

--
-- Name: outbox_lease(text, text, integer, double precision, integer[], boolean, boolean, bigint); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_lease(p_relay text, p_host text, p_pid integer, p_lease_secs double precision, p_release integer[], p_acquire boolean, p_wants_wakeup boolean, p_published bigint) RETURNS TABLE(partition integer, epoch bigint, fair_share integer, relays_alive integer)
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := make_interval(secs => p_lease_secs);
    v_alive integer;
    v_fair  integer;
    v_owned integer;
BEGIN
    INSERT INTO outbox_relays AS r (relay_id, host, pid, lease_secs, wants_wakeup)
    VALUES (p_relay, p_host, p_pid, p_lease_secs, p_wants_wakeup)
    ON CONFLICT (relay_id) DO UPDATE
        SET heartbeat_at = now(), lease_secs = excluded.lease_secs, published = p_published;

    -- Forget relays that have been silent for ten leases.
    DELETE FROM outbox_relays r
     WHERE r.heartbeat_at < now() - make_interval(secs => 10 * r.lease_secs);

    UPDATE outbox_partitions p SET owner = NULL, lease_until = '-infinity'
     WHERE p.owner = p_relay AND p.partition = ANY (coalesce(p_release, '{}'));

    UPDATE outbox_partitions p SET lease_until = now() + v_lease
     WHERE p.owner = p_relay;

    SELECT count(*) INTO v_alive FROM outbox_relays r
     WHERE r.heartbeat_at > now() - make_interval(secs => r.lease_secs);
    v_fair := ceil(64.0 / greatest(v_alive, 1));

    SELECT count(*) INTO v_owned FROM outbox_partitions p WHERE p.owner = p_relay;

    IF p_acquire AND v_owned < v_fair
       AND EXISTS (SELECT 1 FROM outbox_partitions p
                    WHERE p.owner IS NULL OR p.lease_until < clock_timestamp()) THEN
        -- Wait for running claims to finish: the new owner must see every seq they assigned.
        PERFORM pg_advisory_xact_lock(outbox_claim_lock_key());
        UPDATE outbox_partitions p
           SET owner = p_relay, epoch = p.epoch + 1, lease_until = clock_timestamp() + v_lease
         WHERE p.partition IN (
               SELECT q.partition FROM outbox_partitions q
                WHERE q.owner IS NULL OR q.lease_until < clock_timestamp()
                ORDER BY q.partition
                LIMIT v_fair - v_owned
                  FOR UPDATE SKIP LOCKED);
    END IF;

    RETURN QUERY
        SELECT p.partition, p.epoch, v_fair, v_alive
          FROM outbox_partitions p
         WHERE p.owner = p_relay
         ORDER BY p.partition;
END
$$;

--
-- Name: outbox_leave(text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_leave(p_relay text) RETURNS void
    LANGUAGE sql
    SET search_path TO 'public'
    AS $$
    UPDATE outbox_partitions SET owner = NULL, lease_until = '-infinity' WHERE owner = p_relay;
    DELETE FROM outbox_relays WHERE relay_id = p_relay;
$$;

--
-- Name: outbox_message_bytes(text, text, text, text, text, text, text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_message_bytes(aggregate_type text, aggregate_id text, event_type text, routing_key text, body text, headers text, traceparent text, tracestate text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT octet_length(body) + octet_length(headers)
           + coalesce(octet_length(traceparent), 0) + coalesce(octet_length(tracestate), 0)
           + octet_length(aggregate_type) + octet_length(aggregate_id)
           + octet_length(event_type) + octet_length(routing_key)
$$;

--
-- Name: outbox_number_due(integer[], integer); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_number_due(p_owned integer[], p_limit integer) RETURNS TABLE(aggregate_type text, aggregate_id text)
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
#variable_conflict use_column
DECLARE
    r         record;
    v_seq     bigint;
    -- Keys whose counter a producer held: their later due rows wait too, so that a key's
    -- scheduled rows take their numbers in the order they became due.
    v_skipped text[] := '{}';
BEGIN
    FOR r IN
        SELECT e.id, e.aggregate_type AS t, e.aggregate_id AS i
          FROM outbox_events e
         WHERE e.seq IS NULL AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at <= now()
           AND outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (p_owned)
         ORDER BY e.available_at, e.id
         LIMIT p_limit
    LOOP
        CONTINUE WHEN r.t || chr(31) || r.i = ANY (v_skipped);
        SELECT k.last_seq INTO v_seq FROM outbox_key_seq k
         WHERE k.aggregate_type = r.t AND k.aggregate_id = r.i
           FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            IF EXISTS (SELECT 1 FROM outbox_key_seq k
                        WHERE k.aggregate_type = r.t AND k.aggregate_id = r.i) THEN
                v_skipped := v_skipped || (r.t || chr(31) || r.i);
                CONTINUE;
            END IF;
            INSERT INTO outbox_key_seq (aggregate_type, aggregate_id, last_seq)
            VALUES (r.t, r.i, 0)
            ON CONFLICT DO NOTHING
            RETURNING last_seq INTO v_seq;
            IF v_seq IS NULL THEN
                v_skipped := v_skipped || (r.t || chr(31) || r.i);
                CONTINUE;
            END IF;
        END IF;
        UPDATE outbox_events e SET seq = v_seq + 1
         WHERE e.id = r.id AND e.seq IS NULL AND e.dispatched_at IS NULL AND e.parked_at IS NULL;
        CONTINUE WHEN NOT FOUND;
        UPDATE outbox_key_seq k SET last_seq = v_seq + 1
         WHERE k.aggregate_type = r.t AND k.aggregate_id = r.i;
        aggregate_type := r.t;
        aggregate_id := r.i;
        RETURN NEXT;
    END LOOP;
END
$$;

--
-- Name: outbox_number_event(); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_number_event() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $$
BEGIN
    IF NEW.available_at > NEW.created_at THEN
        -- Scheduled: numbered once due (outbox_number_due). The key gets its counter now,
        -- so that numbering it later never has to wait for a producer creating it.
        NEW.seq := NULL;
        INSERT INTO public.outbox_key_seq (aggregate_type, aggregate_id, last_seq)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 0)
        ON CONFLICT DO NOTHING;
        RETURN NEW;
    END IF;
    INSERT INTO public.outbox_key_seq AS k (aggregate_type, aggregate_id, last_seq)
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
    IF EXISTS (SELECT 1 FROM public.outbox_events e WHERE e.event_id = NEW.event_id)
       OR (NEW.idempotency_key IS NOT NULL
           AND EXISTS (SELECT 1 FROM public.outbox_events e
                        WHERE e.aggregate_type = NEW.aggregate_type
                          AND e.idempotency_key = NEW.idempotency_key)) THEN
        UPDATE public.outbox_key_seq k SET last_seq = k.last_seq - 1
         WHERE k.aggregate_type = NEW.aggregate_type AND k.aggregate_id = NEW.aggregate_id;
        NEW.seq := NULL;
    END IF;
    RETURN NEW;
END
$$;

--
-- Name: outbox_partition_of(text, text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_partition_of(aggregate_type text, aggregate_id text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT hashtext(aggregate_type || E'\x1f' || aggregate_id) & 63 $$;

--
-- Name: outbox_record_deleted(); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_record_deleted() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
BEGIN
    INSERT INTO outbox_retention_horizon AS h (deleted_to_id, deleted_to_created_at, deleted_rows)
    SELECT max(g.id), max(g.created_at), count(*)
      FROM outbox_deleted g
     WHERE g.dispatched_at IS NOT NULL
    HAVING count(*) > 0
    ON CONFLICT (only_row) DO UPDATE
       SET deleted_to_id = greatest(h.deleted_to_id, excluded.deleted_to_id),
           deleted_to_created_at = greatest(h.deleted_to_created_at, excluded.deleted_to_created_at),
           deleted_rows = h.deleted_rows + excluded.deleted_rows,
           updated_at = now();
    RETURN NULL;
END
$$;

--
-- Name: outbox_record_failures(bigint[], text[], smallint[], integer, boolean, text, integer[], bigint[]); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_record_failures(p_ids bigint[], p_reasons text[], p_kinds smallint[], p_max_attempts integer, p_block_key boolean, p_relay text, p_partitions integer[], p_epochs bigint[]) RETURNS TABLE(id bigint, attempts integer, parked boolean, outcome text)
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock_shared(outbox_claim_lock_key());
    RETURN QUERY
    WITH mine AS (
        SELECT p.partition
          FROM outbox_partitions p, unnest(p_partitions, p_epochs) AS l(partition, epoch)
         WHERE p.partition = l.partition AND p.epoch = l.epoch
           AND p.owner = p_relay AND p.lease_until > clock_timestamp()
    ), f AS (
        SELECT * FROM unnest(p_ids, p_reasons, p_kinds) AS f(id, reason, kind)
    ), u AS (
        UPDATE outbox_events e
           SET attempts = e.attempts + 1,
               last_error = f.reason,
               parked_at = CASE WHEN f.kind = 2 OR (f.kind = 1 AND e.attempts + 1 >= p_max_attempts)
                                THEN now() END
          FROM f
         WHERE e.id = f.id AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND outbox_partition_of(e.aggregate_type, e.aggregate_id) IN (SELECT m.partition FROM mine m)
        RETURNING e.id, e.aggregate_type, e.aggregate_id, e.seq, e.attempts,
                  e.parked_at IS NOT NULL AS parked
    ), blocked AS (
        UPDATE outbox_key_seq k SET blocked_seq = u.seq
          FROM u
         WHERE p_block_key AND u.parked
           AND k.aggregate_type = u.aggregate_type AND k.aggregate_id = u.aggregate_id
        RETURNING k.aggregate_type
    )
    SELECT u.id, u.attempts, u.parked, 'recorded'::text FROM u
    UNION ALL
    SELECT f.id, coalesce(e.attempts, 0), coalesce(e.parked_at IS NOT NULL, false),
           CASE WHEN e.id IS NULL THEN 'gone'
                WHEN outbox_partition_of(e.aggregate_type, e.aggregate_id) NOT IN (SELECT m.partition FROM mine m)
                     THEN 'fenced'
                WHEN e.dispatched_at IS NOT NULL THEN 'dispatched'
                WHEN e.parked_at IS NOT NULL THEN 'parked'
                ELSE 'gone' END
      FROM f LEFT JOIN outbox_events e ON e.id = f.id
     WHERE NOT EXISTS (SELECT 1 FROM u WHERE u.id = f.id);
END
$$;

--
-- Name: outbox_redrive(bigint[], boolean); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_redrive(p_ids bigint[], p_dry_run boolean DEFAULT false) RETURNS TABLE(id bigint, event_id uuid, aggregate_type text, aggregate_id text, seq_before bigint, renumbered boolean)
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
#variable_conflict use_column
DECLARE
    k       record;
    v_base  bigint;
    v_ids   bigint[] := '{}';
    v_seqs  bigint[] := '{}';
    v_renum boolean[] := '{}';
BEGIN
    FOR k IN
        WITH sel AS (
            SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
              FROM outbox_events e
             WHERE e.id = ANY (p_ids) AND e.parked_at IS NOT NULL
        ), plan AS (
            SELECT s.*, s.seq IS NULL OR EXISTS (
                       SELECT 1 FROM outbox_events o
                        WHERE o.aggregate_type = s.aggregate_type AND o.aggregate_id = s.aggregate_id
                          AND o.seq > s.seq AND NOT (o.id = ANY (p_ids))
                          AND (o.dispatched_at IS NOT NULL OR o.parked_at IS NOT NULL
                               OR NOT EXISTS (SELECT 1 FROM outbox_key_seq c
                                               WHERE c.aggregate_type = s.aggregate_type
                                                 AND c.aggregate_id = s.aggregate_id
                                                 AND c.blocked_seq = s.seq))) AS renumber
              FROM sel s
        )
        SELECT p.aggregate_type AS t, p.aggregate_id AS i, bool_or(p.renumber) AS renumber,
               array_agg(p.id ORDER BY p.seq NULLS LAST, p.id) AS ids,
               array_agg(p.seq ORDER BY p.seq NULLS LAST, p.id) AS seqs
          FROM plan p
         GROUP BY p.aggregate_type, p.aggregate_id
         ORDER BY p.aggregate_type, p.aggregate_id
    LOOP
        v_ids := v_ids || k.ids;
        v_seqs := v_seqs || k.seqs;
        v_renum := v_renum || array_fill(k.renumber, ARRAY[cardinality(k.ids)]);
        CONTINUE WHEN p_dry_run;
        v_base := NULL;
        IF k.renumber THEN
            UPDATE outbox_key_seq c
               SET last_seq = greatest(c.last_seq,
                                       coalesce((SELECT max(o.seq) FROM outbox_events o
                                                  WHERE o.aggregate_type = k.t AND o.aggregate_id = k.i), 0))
                              + cardinality(k.ids),
                   blocked_seq = NULL
             WHERE c.aggregate_type = k.t AND c.aggregate_id = k.i
            RETURNING c.last_seq - cardinality(k.ids) INTO v_base;
            IF v_base IS NULL THEN
                INSERT INTO outbox_key_seq (aggregate_type, aggregate_id, last_seq)
                SELECT k.t, k.i, coalesce(max(o.seq), 0) + cardinality(k.ids)
                  FROM outbox_events o WHERE o.aggregate_type = k.t AND o.aggregate_id = k.i
                RETURNING last_seq - cardinality(k.ids) INTO v_base;
            END IF;
        ELSE
            UPDATE outbox_key_seq c SET blocked_seq = NULL
             WHERE c.aggregate_type = k.t AND c.aggregate_id = k.i AND c.blocked_seq IS NOT NULL;
        END IF;
        UPDATE outbox_events e
           SET parked_at = NULL,
               attempts = 0,
               seq = CASE WHEN k.renumber THEN v_base + array_position(k.ids, e.id) ELSE e.seq END
         WHERE e.id = ANY (k.ids);
    END LOOP;

    RETURN QUERY
    SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, x.seq_before, x.renumbered
      FROM unnest(v_ids, v_seqs, v_renum) AS x(id, seq_before, renumbered)
      JOIN outbox_events e ON e.id = x.id
     ORDER BY e.id;

    IF NOT p_dry_run THEN
        PERFORM pg_notify('outbox_events:' || current_schema(), '');
    END IF;
END
$$;

--
-- Name: outbox_redrive_counter_floor(); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_redrive_counter_floor() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
BEGIN
    IF NEW.parked_at IS NULL AND OLD.parked_at IS NOT NULL AND NEW.seq IS NULL THEN
        UPDATE outbox_key_seq k
           SET last_seq = greatest(k.last_seq,
                                   (SELECT max(o.seq) FROM outbox_events o
                                     WHERE o.aggregate_type = NEW.aggregate_type
                                       AND o.aggregate_id = NEW.aggregate_id
                                       AND o.dispatched_at IS NOT NULL))
         WHERE k.aggregate_type = NEW.aggregate_type AND k.aggregate_id = NEW.aggregate_id;
    END IF;
    RETURN NULL;
END
$$;

--
-- Name: outbox_refresh_statistics(integer); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_refresh_statistics(p_seen integer) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_stat_user_tables t
                WHERE t.relid = 'public.outbox_events'::regclass
                  AND greatest(t.last_analyze, t.last_autoanalyze) > now() - interval '10 seconds')
       OR (SELECT s.null_frac * c.reltuples
             FROM pg_catalog.pg_stats s, pg_catalog.pg_class c
            WHERE s.schemaname = 'public' AND s.tablename = 'outbox_events'
              AND s.attname = 'dispatched_at' AND c.oid = 'public.outbox_events'::regclass) >= p_seen
    THEN
        RETURN false;
    END IF;
    ANALYZE (SKIP_LOCKED) public.outbox_events;
    RETURN true;
END;
$$;

--
-- Name: outbox_set_wakeup(text, boolean); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_set_wakeup(p_relay text, p_wanted boolean) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
BEGIN
    -- One relay at a time, each computing from what the others committed before it.
    PERFORM pg_advisory_xact_lock(hashtextextended('outbox-relay:wakeup:' || current_schema(), 0));
    UPDATE outbox_relays SET wants_wakeup = p_wanted WHERE relay_id = p_relay;
    PERFORM setval('outbox_wakeup', greatest(1, coalesce(
        (SELECT max((extract(epoch FROM r.heartbeat_at) + 3 * r.lease_secs) * 1000)::bigint
           FROM outbox_relays r
          WHERE r.wants_wakeup), 1)));
END
$$;

--
-- Name: outbox_utf8_valid(text); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_utf8_valid(t text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    AS $$
BEGIN
    IF t IS NULL OR t !~ '[\x80-\xff]' THEN
        RETURN true;
    END IF;
    PERFORM convert_to(t, 'UTF8');
    RETURN true;
EXCEPTION WHEN character_not_in_repertoire OR untranslatable_character THEN
    RETURN false;
END
$$;

--
-- Name: outbox_uuid_v7(); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_uuid_v7() RETURNS uuid
    LANGUAGE sql PARALLEL SAFE
    AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),  -- version 4 (0100) becomes 7 (0111)
        'hex')::uuid
$$;

--
-- Name: outbox_wakeup(); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.outbox_wakeup() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'public'
    AS $$
BEGIN
    PERFORM pg_notify('outbox_events:' || TG_TABLE_SCHEMA, '');
    RETURN NULL;
END
$$;

--
-- Name: outbox_budget_reservations; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_budget_reservations (
    effect_id bigint NOT NULL,
    tenant text NOT NULL,
    quota_key text NOT NULL,
    amount bigint NOT NULL,
    state text DEFAULT 'held'::text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    settled_at timestamp with time zone,
    CONSTRAINT outbox_budget_reservations_amount_check CHECK ((amount > 0)),
    CONSTRAINT outbox_budget_reservations_state_check CHECK ((state = ANY (ARRAY['held'::text, 'consumed'::text, 'released'::text])))
);

--
-- Name: outbox_budgets; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_budgets (
    tenant text NOT NULL,
    quota_key text NOT NULL,
    remaining bigint NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_budgets_remaining_check CHECK ((remaining >= 0))
);

--
-- Name: outbox_consumer_groups; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_consumer_groups (
    consumer text NOT NULL,
    partitions integer NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_consumer_groups_partitions_check CHECK (((partitions >= 1) AND (partitions <= 1000)))
);

--
-- Name: outbox_consumer_members; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_consumer_members (
    consumer text NOT NULL,
    member text NOT NULL,
    joined_at timestamp with time zone DEFAULT now() NOT NULL,
    lease_until timestamp with time zone NOT NULL
);

--
-- Name: outbox_effect_strays; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_effect_strays (
    id bigint NOT NULL,
    effect_id bigint NOT NULL,
    worker text NOT NULL,
    external_id text NOT NULL,
    error text NOT NULL,
    recorded_at timestamp with time zone DEFAULT now() NOT NULL,
    resolved_at timestamp with time zone
);

--
-- Name: outbox_effect_strays_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

ALTER TABLE public.outbox_effect_strays ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_effect_strays_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: outbox_effects; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_effects (
    id bigint NOT NULL,
    effect_key text NOT NULL,
    destination text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    state text DEFAULT 'queued'::text NOT NULL,
    claimed_by text,
    claimed_at timestamp with time zone,
    lease_until timestamp with time zone,
    external_id text,
    attempts integer DEFAULT 0 NOT NULL,
    last_error text,
    uncertain boolean DEFAULT false NOT NULL,
    cancel_requested_at timestamp with time zone,
    withdrawn_at timestamp with time zone,
    tenant text,
    quota_key text,
    cost bigint,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    sent_at timestamp with time zone,
    order_key text,
    CONSTRAINT outbox_effects_budget_complete CHECK ((((tenant IS NULL) = (quota_key IS NULL)) AND ((tenant IS NULL) = (cost IS NULL)))),
    CONSTRAINT outbox_effects_cost_check CHECK (((cost IS NULL) OR (cost > 0))),
    CONSTRAINT outbox_effects_state_check CHECK ((state = ANY (ARRAY['queued'::text, 'sending'::text, 'sent'::text, 'failed'::text, 'cancelled'::text])))
);

--
-- Name: outbox_effects_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

ALTER TABLE public.outbox_effects ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_effects_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: outbox_events; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_events (
    id bigint NOT NULL,
    event_id uuid DEFAULT public.outbox_uuid_v7() NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    routing_key text,
    available_at timestamp with time zone DEFAULT now() NOT NULL,
    traceparent text,
    tracestate text,
    dispatched_at timestamp with time zone,
    attempts integer DEFAULT 0 NOT NULL,
    last_error text,
    parked_at timestamp with time zone,
    seq bigint,
    idempotency_key text,
    CONSTRAINT outbox_events_headers_reserved CHECK (((headers = '{}'::jsonb) OR public.outbox_headers_allowed(headers))),
    CONSTRAINT outbox_events_routing_key_length CHECK (((routing_key IS NULL) OR (octet_length(routing_key) <= 255)))
)
WITH (autovacuum_vacuum_scale_factor='0.01', autovacuum_vacuum_threshold='5000', autovacuum_vacuum_cost_delay='1');

--
-- Name: outbox_events_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

ALTER TABLE public.outbox_events ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_events_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: outbox_inbox; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_inbox (
    consumer text NOT NULL,
    event_id uuid NOT NULL,
    aggregate_type text,
    aggregate_id text,
    seq bigint,
    outcome text DEFAULT 'applied'::text NOT NULL,
    reason text,
    handled_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_inbox_outcome_check CHECK ((outcome = ANY (ARRAY['applied'::text, 'dead'::text])))
);

--
-- Name: outbox_inbox_attempts; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_inbox_attempts (
    consumer text NOT NULL,
    event_id uuid NOT NULL,
    attempts integer DEFAULT 1 NOT NULL,
    first_at timestamp with time zone DEFAULT now() NOT NULL,
    last_at timestamp with time zone DEFAULT now() NOT NULL
);

--
-- Name: TABLE outbox_inbox_attempts; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON TABLE public.outbox_inbox_attempts IS 'attempts of an event a consumer counted before running them (redeliveries, retries in place); written by outbox_inbox_attempt, deleted by outbox_consumer_prune';

--
-- Name: outbox_inbox_gaps; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_inbox_gaps (
    id bigint NOT NULL,
    consumer text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    expected_seq bigint NOT NULL,
    got_seq bigint NOT NULL,
    event_id uuid NOT NULL,
    action text NOT NULL,
    reported_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_inbox_gaps_action_check CHECK ((action = ANY (ARRAY['skipped'::text, 'dead'::text, 'jumped'::text, 'late'::text])))
);

--
-- Name: outbox_inbox_gaps_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

ALTER TABLE public.outbox_inbox_gaps ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_inbox_gaps_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: outbox_inbox_held; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_inbox_held (
    consumer text NOT NULL,
    partition integer NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    seq bigint NOT NULL,
    event_id uuid NOT NULL,
    event_type text,
    routing_key text NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    body bytea NOT NULL,
    held_at timestamp with time zone DEFAULT now() NOT NULL,
    parked_after bigint
);

--
-- Name: COLUMN outbox_inbox_held.parked_after; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.outbox_inbox_held.parked_after IS 'a parked event: the highest seq of its key still unacked in the member''s hand when it was parked; it is applied once the key''s last_seq reaches it (NULL: held behind a blocked key or an earlier held event)';

--
-- Name: outbox_inbox_keys; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_inbox_keys (
    consumer text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    last_seq bigint DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    blocked_seq bigint,
    blocked_at timestamp with time zone,
    blocked_reason text
);

--
-- Name: outbox_key_seq; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_key_seq (
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    last_seq bigint NOT NULL,
    numbered_ids bigint[] DEFAULT '{}'::bigint[] NOT NULL,
    numbered_seqs bigint[] DEFAULT '{}'::bigint[] NOT NULL,
    blocked_seq bigint
);

--
-- Name: outbox_partitions; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_partitions (
    partition integer NOT NULL,
    owner text,
    epoch bigint DEFAULT 0 NOT NULL,
    lease_until timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    CONSTRAINT outbox_partitions_partition_check CHECK (((partition >= 0) AND (partition <= 63)))
);

--
-- Name: outbox_relays; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_relays (
    relay_id text NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    lease_secs double precision NOT NULL,
    wants_wakeup boolean DEFAULT true NOT NULL,
    published bigint DEFAULT 0 NOT NULL
);

--
-- Name: outbox_replays; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_replays (
    name text NOT NULL,
    queue text NOT NULL,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    created_from timestamp with time zone,
    created_before timestamp with time zone,
    from_id bigint,
    to_id bigint,
    upper_id bigint NOT NULL,
    last_id bigint NOT NULL,
    total bigint NOT NULL,
    published bigint DEFAULT 0 NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone
);

--
-- Name: outbox_retention_horizon; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_retention_horizon (
    only_row boolean DEFAULT true NOT NULL,
    deleted_to_id bigint NOT NULL,
    deleted_to_created_at timestamp with time zone NOT NULL,
    deleted_rows bigint NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_retention_horizon_only_row_check CHECK (only_row)
);

--
-- Name: outbox_schema_functions; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_schema_functions (
    name text NOT NULL,
    revision integer NOT NULL,
    checksum text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);

--
-- Name: outbox_schema_migrations; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.outbox_schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);

--
-- Name: outbox_wakeup; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.outbox_wakeup
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

--
-- Name: outbox_budget_reservations outbox_budget_reservations_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_budget_reservations
    ADD CONSTRAINT outbox_budget_reservations_pkey PRIMARY KEY (effect_id);

--
-- Name: outbox_budgets outbox_budgets_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_budgets
    ADD CONSTRAINT outbox_budgets_pkey PRIMARY KEY (tenant, quota_key);

--
-- Name: outbox_consumer_groups outbox_consumer_groups_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_consumer_groups
    ADD CONSTRAINT outbox_consumer_groups_pkey PRIMARY KEY (consumer);

--
-- Name: outbox_consumer_members outbox_consumer_members_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_consumer_members
    ADD CONSTRAINT outbox_consumer_members_pkey PRIMARY KEY (consumer, member);

--
-- Name: outbox_effect_strays outbox_effect_strays_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_effect_strays
    ADD CONSTRAINT outbox_effect_strays_pkey PRIMARY KEY (id);

--
-- Name: outbox_effects outbox_effects_key; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_effects
    ADD CONSTRAINT outbox_effects_key UNIQUE (effect_key);

--
-- Name: outbox_effects outbox_effects_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_effects
    ADD CONSTRAINT outbox_effects_pkey PRIMARY KEY (id);

--
-- Name: outbox_events outbox_events_event_id_key; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_events
    ADD CONSTRAINT outbox_events_event_id_key UNIQUE (event_id);

--
-- Name: outbox_events outbox_events_headers_size; Type: CHECK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE public.outbox_events
    ADD CONSTRAINT outbox_events_headers_size CHECK ((octet_length((headers)::text) <= 65536)) NOT VALID;

--
-- Name: outbox_events outbox_events_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_events
    ADD CONSTRAINT outbox_events_pkey PRIMARY KEY (id);

--
-- Name: outbox_inbox_attempts outbox_inbox_attempts_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_inbox_attempts
    ADD CONSTRAINT outbox_inbox_attempts_pkey PRIMARY KEY (consumer, event_id);

--
-- Name: outbox_inbox_gaps outbox_inbox_gaps_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_inbox_gaps
    ADD CONSTRAINT outbox_inbox_gaps_pkey PRIMARY KEY (id);

--
-- Name: outbox_inbox_held outbox_inbox_held_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_inbox_held
    ADD CONSTRAINT outbox_inbox_held_pkey PRIMARY KEY (consumer, aggregate_type, aggregate_id, seq);

--
-- Name: outbox_inbox_keys outbox_inbox_keys_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_inbox_keys
    ADD CONSTRAINT outbox_inbox_keys_pkey PRIMARY KEY (consumer, aggregate_type, aggregate_id);

--
-- Name: outbox_inbox outbox_inbox_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_inbox
    ADD CONSTRAINT outbox_inbox_pkey PRIMARY KEY (consumer, event_id);

--
-- Name: outbox_key_seq outbox_key_seq_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_key_seq
    ADD CONSTRAINT outbox_key_seq_pkey PRIMARY KEY (aggregate_type, aggregate_id);

--
-- Name: outbox_partitions outbox_partitions_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_partitions
    ADD CONSTRAINT outbox_partitions_pkey PRIMARY KEY (partition);

--
-- Name: outbox_relays outbox_relays_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_relays
    ADD CONSTRAINT outbox_relays_pkey PRIMARY KEY (relay_id);

--
-- Name: outbox_replays outbox_replays_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_replays
    ADD CONSTRAINT outbox_replays_pkey PRIMARY KEY (name);

--
-- Name: outbox_retention_horizon outbox_retention_horizon_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_retention_horizon
    ADD CONSTRAINT outbox_retention_horizon_pkey PRIMARY KEY (only_row);

--
-- Name: outbox_schema_functions outbox_schema_functions_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_schema_functions
    ADD CONSTRAINT outbox_schema_functions_pkey PRIMARY KEY (name);

--
-- Name: outbox_schema_migrations outbox_schema_migrations_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_schema_migrations
    ADD CONSTRAINT outbox_schema_migrations_pkey PRIMARY KEY (version);

--
-- Name: outbox_budget_reservations_budget; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_budget_reservations_budget ON public.outbox_budget_reservations USING btree (tenant, quota_key) WHERE (state = 'held'::text);

--
-- Name: outbox_effect_strays_open; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_effect_strays_open ON public.outbox_effect_strays USING btree (effect_id) WHERE (resolved_at IS NULL);

--
-- Name: outbox_effects_finished; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_effects_finished ON public.outbox_effects USING btree (updated_at) WHERE (state = ANY (ARRAY['sent'::text, 'failed'::text, 'cancelled'::text]));

--
-- Name: outbox_effects_order; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_effects_order ON public.outbox_effects USING btree (order_key, id) WHERE ((order_key IS NOT NULL) AND (state = ANY (ARRAY['queued'::text, 'sending'::text])));

--
-- Name: outbox_effects_sending; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_effects_sending ON public.outbox_effects USING btree (lease_until) WHERE (state = 'sending'::text);

--
-- Name: outbox_events_dispatched; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_events_dispatched ON public.outbox_events USING brin (dispatched_at) WITH (autosummarize='on');

--
-- Name: outbox_events_idempotency_key; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX outbox_events_idempotency_key ON public.outbox_events USING btree (aggregate_type, idempotency_key) WHERE (idempotency_key IS NOT NULL);

--
-- Name: outbox_events_parked; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_events_parked ON public.outbox_events USING btree (aggregate_type, aggregate_id) WHERE (parked_at IS NOT NULL);

--
-- Name: outbox_events_pending; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_events_pending ON public.outbox_events USING btree (id) WHERE ((dispatched_at IS NULL) AND (parked_at IS NULL) AND (available_at <= created_at));

--
-- Name: outbox_events_pending_key; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_events_pending_key ON public.outbox_events USING btree (aggregate_type, aggregate_id, seq, id) WHERE ((dispatched_at IS NULL) AND (parked_at IS NULL));

--
-- Name: outbox_events_scheduled; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_events_scheduled ON public.outbox_events USING btree (available_at, id) WHERE ((dispatched_at IS NULL) AND (parked_at IS NULL) AND (available_at > created_at));

--
-- Name: outbox_events_unnumbered; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_events_unnumbered ON public.outbox_events USING btree (available_at, id) WHERE ((seq IS NULL) AND (dispatched_at IS NULL) AND (parked_at IS NULL));

--
-- Name: outbox_inbox_handled; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_inbox_handled ON public.outbox_inbox USING btree (handled_at);

--
-- Name: outbox_inbox_held_partition; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX outbox_inbox_held_partition ON public.outbox_inbox_held USING btree (consumer, partition);

--
-- Name: outbox_events outbox_events_deleted; Type: TRIGGER; Schema: public; Owner: -
--

CREATE TRIGGER outbox_events_deleted AFTER DELETE ON public.outbox_events REFERENCING OLD TABLE AS outbox_deleted FOR EACH STATEMENT EXECUTE FUNCTION public.outbox_record_deleted();

--
-- Name: outbox_events outbox_events_number; Type: TRIGGER; Schema: public; Owner: -
--

CREATE TRIGGER outbox_events_number BEFORE INSERT ON public.outbox_events FOR EACH ROW EXECUTE FUNCTION public.outbox_number_event();

--
-- Name: outbox_events outbox_events_redrive_floor; Type: TRIGGER; Schema: public; Owner: -
--

CREATE TRIGGER outbox_events_redrive_floor AFTER UPDATE OF parked_at ON public.outbox_events FOR EACH ROW WHEN (((old.parked_at IS NOT NULL) AND (new.parked_at IS NULL))) EXECUTE FUNCTION public.outbox_redrive_counter_floor();

--
-- Name: outbox_events outbox_events_wakeup; Type: TRIGGER; Schema: public; Owner: -
--

CREATE TRIGGER outbox_events_wakeup AFTER INSERT ON public.outbox_events FOR EACH STATEMENT WHEN ((pg_sequence_last_value('public.outbox_wakeup'::regclass) > ((date_part('epoch'::text, now()) * (1000)::double precision))::bigint)) EXECUTE FUNCTION public.outbox_wakeup();

--
-- Name: outbox_budget_reservations outbox_budget_reservations_effect_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_budget_reservations
    ADD CONSTRAINT outbox_budget_reservations_effect_id_fkey FOREIGN KEY (effect_id) REFERENCES public.outbox_effects(id) ON DELETE CASCADE;

--
-- Name: outbox_budget_reservations outbox_budget_reservations_tenant_quota_key_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_budget_reservations
    ADD CONSTRAINT outbox_budget_reservations_tenant_quota_key_fkey FOREIGN KEY (tenant, quota_key) REFERENCES public.outbox_budgets(tenant, quota_key);

--
-- Name: outbox_effect_strays outbox_effect_strays_effect_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.outbox_effect_strays
    ADD CONSTRAINT outbox_effect_strays_effect_id_fkey FOREIGN KEY (effect_id) REFERENCES public.outbox_effects(id) ON DELETE CASCADE;

--
-- Name: SEQUENCE outbox_wakeup; Type: ACL; Schema: public; Owner: -
--

GRANT SELECT ON SEQUENCE public.outbox_wakeup TO PUBLIC;
