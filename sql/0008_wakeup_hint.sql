-- The insert wake-up costs producers nothing while no relay wants it.
--
-- The trigger's function ran for every producer statement to look up, in outbox_relays,
-- whether some relay wanted a NOTIFY: a PL/pgSQL call and a query per INSERT, 8-15 us of
-- a 40 us insert statement measured here, paid while the relay was busy and did not want
-- one. Now relays publish the answer in a sequence, outbox_wakeup: its last value is the
-- time (unix milliseconds) until which some live relay asked for the wake-up. The
-- trigger's WHEN reads it (a built-in function, no query, no PL/pgSQL), so the function,
-- and its NOTIFY, run only while a relay wants them. A sequence because its value is
-- shared by every session at once and set without a transaction (setval), which is all a
-- hint needs: the relay polls once more after asking for the wake-up, as before.
--
-- Relays write it through outbox_set_wakeup (when their wish changes, and again every
-- lease round while they want it, so it runs out within three leases of a relay dying);
-- called with no relay, it only computes the value from outbox_relays.
-- A relay older than this migration updates outbox_relays directly and so never turns
-- the hint on: it keeps working on its polls alone until it is replaced.

CREATE SEQUENCE outbox_wakeup;
-- Every role that may insert reads it in the trigger's WHEN (pg_sequence_last_value checks
-- SELECT); the value says only whether a relay wants a NOTIFY.
GRANT SELECT ON SEQUENCE outbox_wakeup TO PUBLIC;

CREATE FUNCTION outbox_set_wakeup(p_relay text, p_wanted boolean) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT
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

-- Called only while the hint is on, so it sends without asking again.
CREATE OR REPLACE FUNCTION outbox_wakeup() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM pg_notify('outbox_events:' || TG_TABLE_SCHEMA, '');
    RETURN NULL;
END
$$;

DROP TRIGGER outbox_events_wakeup ON outbox_events;
CREATE TRIGGER outbox_events_wakeup AFTER INSERT ON outbox_events
    FOR EACH STATEMENT
    WHEN (pg_sequence_last_value('outbox_wakeup'::regclass) > (date_part('epoch', now()) * 1000)::bigint)
    EXECUTE FUNCTION outbox_wakeup();

-- Relays running now asked for the wake-up through outbox_relays (no relay is named: the
-- value is only computed).
SELECT outbox_set_wakeup(NULL, NULL);
