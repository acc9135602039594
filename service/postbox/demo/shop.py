"""The demo's application: an order service's handlers, its tables and its Postbox settings.

`postbox demo` runs these handlers in real worker processes (`--app postbox.demo.shop:registry`);
:mod:`postbox.demo.scenario` plays the events and narrates.
"""

from __future__ import annotations

from typing import Any

from postbox.failures.outcomes import Permanent, Transient
from postbox.inbox.handlers import Context, Message, Registry

__all__ = ["BUSINESS_DDL", "CONSUMER", "POLICY_TOML", "SHIPPING", "events", "registry"]

CONSUMER = "orders"
SHIPPING = "shipping"

# --- the handlers the worker processes run -----------------------------------------------------

registry = Registry()

BUSINESS_DDL = """
CREATE TABLE IF NOT EXISTS demo_orders (
    order_id  text PRIMARY KEY,
    state     text NOT NULL,
    amount    numeric,
    updated   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS demo_gateway_outages (
    order_id  text PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS demo_shipments (
    order_id  text PRIMARY KEY,
    amount    numeric NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS demo_log (
    id        bigserial PRIMARY KEY,
    order_id  text NOT NULL,
    event     text NOT NULL,
    attempt   integer NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


@registry.handler(CONSUMER)
def handle_order_event(message: Message, ctx: Context) -> None:
    """Apply one order event; the business write and the done mark commit together."""
    order = message.key
    payload = message.payload if isinstance(message.payload, dict) else {}
    row = ctx.conn.execute("SELECT state FROM demo_orders WHERE order_id = %s", (order,)).fetchone()
    state = row[0] if row else None
    if message.type == "created":
        ctx.conn.execute(
            "INSERT INTO demo_orders (order_id, state) VALUES (%s, 'created') ON CONFLICT DO NOTHING",
            (order,),
        )
    elif message.type == "paid":
        if "amount" not in payload:
            raise Permanent("malformed paid event: required field 'amount' is missing")
        fail_times = int(payload.get("gateway_fails", 0))
        if message.attempt <= fail_times:
            raise Transient(f"payment gateway unavailable (attempt {message.attempt})")
        if ctx.conn.execute("SELECT 1 FROM demo_gateway_outages WHERE order_id = %s", (order,)).fetchone():
            raise Transient("payment gateway rejects this merchant: outage")
        ctx.conn.execute(
            "UPDATE demo_orders SET state = 'paid', amount = %s, updated = clock_timestamp() WHERE order_id = %s",
            (payload["amount"], order),
        )
        # The follow-up event commits with the payment (transactional outbox); the relay sends it.
        ctx.publish(
            SHIPPING, {"order": order, "amount": payload["amount"]}, key=order, type="shipment.requested"
        )
    elif message.type == "shipped":
        if state != "paid":
            raise Permanent(f"cannot ship order {order} in state {state}")
        ctx.conn.execute(
            "UPDATE demo_orders SET state = 'shipped', updated = clock_timestamp() WHERE order_id = %s",
            (order,),
        )
    else:
        raise Permanent(f"unknown event type {message.type!r}")
    ctx.conn.execute(
        "INSERT INTO demo_log (order_id, event, attempt) VALUES (%s, %s, %s)",
        (order, message.type, message.attempt),
    )


@registry.handler(SHIPPING)
def handle_shipment_request(message: Message, ctx: Context) -> None:
    """The second service: record the shipment request the relay delivered to its inbox."""
    payload = message.payload if isinstance(message.payload, dict) else {}
    ctx.conn.execute(
        "INSERT INTO demo_shipments (order_id, amount) VALUES (%s, %s)", (payload["order"], payload["amount"])
    )


# --- the settings and the events --------------------------------------------------------------

POLICY_TOML = """
[postbox]
dedup_retention_seconds = 604800

[consumers.orders]
sequence_mode = "gapless"
on_dead_letter = "block"
retry = { strategy = "exponential_full_jitter", base_delay = 0.2, max_delay = 1.0, max_attempts = 4 }

[consumers.shipping]
on_dead_letter = "block"

[destinations.shipping]
kind = "postgres"                      # deliver into an inbox (here: this database's)
consumer = "shipping"
"""


def events() -> list[dict[str, Any]]:
    def ev(order: str, seq: int, type_: str, **payload: Any) -> dict[str, Any]:
        return {
            "consumer": CONSUMER,
            "message_id": f"{order}/{seq}",
            "key": order,
            "sequence": seq,
            "type": type_,
            "payload": {"order": order, **payload},
            "correlation_id": f"checkout-{order}",
            "source": "shop.orders",
        }

    return [
        ev("order-1", 1, "created"),
        ev("order-1", 2, "paid", amount=42, gateway_fails=2),  # fails twice, then succeeds
        ev("order-1", 3, "shipped"),  # must wait for paid
        ev("order-2", 1, "created"),
        ev("order-2", 2, "paid", amount=7),
        ev("order-3", 1, "created"),
        ev("order-3", 2, "paid", note="no amount field"),  # malformed: dead-lettered at once
        ev("order-4", 1, "created"),
        ev("order-4", 2, "paid", amount=99),  # the gateway is out for this order: retries run out
        ev("order-4", 3, "shipped"),  # held behind the blocked payment
    ]
