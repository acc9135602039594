"""An example handler app: order events in, shipment requests out, shipments recorded.

Run by ``docker-compose.yml`` (and usable anywhere)::

    postbox worker --consumer orders   --app postbox.examples.orders:registry
    postbox worker --consumer shipping --app postbox.examples.orders:registry

Consumer ``orders``: ``order.paid`` records the payment and publishes ``shipment.requested`` to the
outbox destination ``shipping`` in the same transaction; any other order event records the order's
new state. Consumer ``shipping``: ``shipment.requested`` records a shipment. The business tables
are in ``deploy/initdb/orders_example.sql`` (the compose PostgreSQL creates them at first start).
"""

from __future__ import annotations

from typing import Any

from postbox.failures.outcomes import Permanent
from postbox.inbox.handlers import Context, Message, Registry

__all__ = ["SHIPPING_DESTINATION", "registry"]

SHIPPING_DESTINATION = "shipping"

registry = Registry()


def _payload(message: Message) -> dict[str, Any]:
    if not isinstance(message.payload, dict):
        raise Permanent(f"{message.type} payload must be a JSON object")
    return message.payload


@registry.handler("orders", "order.paid")
def order_paid(message: Message, ctx: Context) -> None:
    """Record the payment and ask for a shipment, atomically with the message's done mark."""
    payload = _payload(message)
    if "amount" not in payload:
        raise Permanent("malformed order.paid event: required field 'amount' is missing")
    ctx.conn.execute(
        """INSERT INTO example_orders (order_id, state, amount) VALUES (%s, 'paid', %s)
           ON CONFLICT (order_id) DO UPDATE SET state = 'paid', amount = excluded.amount,
                                                updated_at = clock_timestamp()""",
        (message.key, payload["amount"]),
    )
    ctx.publish(
        SHIPPING_DESTINATION,
        {"order_id": message.key, "amount": payload["amount"]},
        key=message.key,
        type="shipment.requested",
        message_id=f"{message.message_id}:shipment",
    )


@registry.handler("orders")
def order_event(message: Message, ctx: Context) -> None:
    """Any other order event (``order.created``, ``order.cancelled``, …) becomes the order's state."""
    if not message.type or not message.type.startswith("order."):
        raise Permanent(f"not an order event: {message.type!r}")
    ctx.conn.execute(
        """INSERT INTO example_orders (order_id, state) VALUES (%s, %s)
           ON CONFLICT (order_id) DO UPDATE SET state = excluded.state, updated_at = clock_timestamp()""",
        (message.key, message.type.removeprefix("order.")),
    )


@registry.handler("shipping", "shipment.requested")
def shipment_requested(message: Message, ctx: Context) -> None:
    """Record the shipment once per request (the inbox already deduplicates redeliveries)."""
    payload = _payload(message)
    ctx.conn.execute(
        "INSERT INTO example_shipments (order_id, request_id) VALUES (%s, %s)",
        (payload.get("order_id", message.key), message.message_id),
    )
