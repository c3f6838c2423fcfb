-- The claim and its parts: the current bodies, in one file. `outbox-relay migrate` applies
-- this file after the numbered migrations whenever its revision (kit/src/schema.rs,
-- REPEATABLE) is newer than the one the schema holds, recorded in
-- outbox_schema_functions; every statement is CREATE OR REPLACE, so grants stay. A change
-- to a step of the claim is a change to this file and a new revision; a changed
-- signature or result still needs a numbered migration that drops the old form first.
-- The numbered migrations up to 0015 hold earlier versions of these bodies; this file
-- replaces them.
--
-- Revision 1: the claim's own statements on cached plans (they were planned on every
-- call), and unnumbered rows looked for by one index probe before outbox_number_due runs.

-- Numbers pending rows that are due and have no number yet (scheduled rows now due, rows
-- written while triggers were off), earliest due first, at most p_limit, in partitions
-- p_owned: each takes its key's next seq under the key's counter. A key whose counter a
-- producer holds (its insert not committed) is skipped, never waited for: a later claim
-- numbers it. Returns the keys it numbered rows of. Writes only when such rows exist.
CREATE OR REPLACE FUNCTION outbox_number_due(p_owned integer[], p_limit integer)
RETURNS TABLE (aggregate_type text, aggregate_id text)
LANGUAGE plpgsql SET search_path FROM CURRENT
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

-- The claim's parts. They only read. Their statements run on plans made once per
-- connection, held to index scans and nested loops: what a claim needs whatever the
-- tables' sizes (every read is by index, bounded by p_limit), and never a scan of a whole
-- table (a cached plan outlives the table size it was made for; 0005, 0013).

-- Keys to look at, in order, with each key's first candidate id (0 for keys looked at
-- whatever the cursor): keys named by the relay and keys with due scheduled rows first,
-- then those of the candidate rows (due at insert, pending, from the cursor, by id) in
-- order of their oldest candidate. Keys with a parked row are left out when
-- p_block_parked_keys. Also how far the scan got and how many candidates it read.
CREATE OR REPLACE FUNCTION outbox_claim_keys(
    p_owned integer[],
    p_after bigint,
    p_before bigint,
    p_limit integer,
    p_block_parked_keys boolean,
    p_key_types text[],
    p_key_ids text[],
    p_held bigint[],
    OUT scanned_to bigint,
    OUT scanned integer,
    OUT key_types text[],
    OUT key_ids text[],
    OUT first_ids bigint[]
)
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
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

-- Each key's next rows in seq order, not held, at most p_per_key, keys in order, at most
-- p_limit rows in all; `cut` is the first candidate id of the first key that did not fit
-- (the cursor stops before it). A key's pending rows that the claim can see are a prefix
-- of its numbers: a lower number committed before a higher one was taken.
CREATE OR REPLACE FUNCTION outbox_claim_pick(
    p_key_types text[],
    p_key_ids text[],
    p_first_ids bigint[],
    p_per_key integer,
    p_limit integer,
    p_held bigint[],
    OUT ids bigint[],
    OUT cut bigint
)
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
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

-- The rows to publish, in the order given, as the relay holds them: an oversized row
-- (larger than p_max_message_bytes) or an unreadable one (text that is not UTF-8, only in
-- a SQL_ASCII database) comes back without body, headers or trace context, to be parked;
-- rows stop once their sizes pass p_max_bytes (the first row always comes).
CREATE OR REPLACE FUNCTION outbox_claim_rows(p_ids bigint[], p_max_message_bytes integer, p_max_bytes bigint)
RETURNS TABLE (
    id bigint, event_id uuid, aggregate_type text, aggregate_id text, event_type text,
    routing_key text, body text, body_bytes integer, headers text, traceparent text,
    tracestate text, created_epoch double precision, created_text text, attempts integer,
    seq bigint, partition integer, unreadable text
)
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
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

-- The claim: its parts in order. Same arguments and result since 0002 (a relay of an
-- earlier version calls it too). The first row says where the scan got to (scanned_to,
-- scanned, per_key, next_due), the others are rows. Reads only, unless a due row has no
-- number yet (outbox_number_due) or the statistics are stale (outbox_refresh_statistics,
-- see 0007).
--
-- Its own statements run on plans made once per connection, like its parts': they are
-- small reads by index whatever the tables' sizes. Planned on every call (as until
-- revision 1), they took a third of the claim's time at 500 events/s.
CREATE OR REPLACE FUNCTION outbox_claim(
    p_relay text,
    p_after bigint,
    p_limit integer,
    p_per_key integer,
    p_block_parked_keys boolean,
    p_max_message_bytes integer,
    p_max_bytes bigint,
    p_key_types text[] DEFAULT '{}',
    p_key_ids text[] DEFAULT '{}',
    p_before bigint DEFAULT NULL,
    p_held bigint[] DEFAULT '{}'
) RETURNS TABLE (
    id bigint,
    event_id uuid,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    routing_key text,
    body text,
    body_bytes integer,
    headers text,
    traceparent text,
    tracestate text,
    created_epoch double precision,
    created_text text,
    attempts integer,
    seq bigint,
    partition integer,
    scanned_to bigint,
    scanned integer,
    per_key integer,
    next_due double precision,
    unreadable text
)
LANGUAGE plpgsql SET search_path FROM CURRENT SET plan_cache_mode = force_generic_plan
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
