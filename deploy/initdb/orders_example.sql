-- Business tables of the example handler app postbox.examples.orders.
-- The compose PostgreSQL runs this file at its first start (docker-entrypoint-initdb.d);
-- elsewhere: psql "$POSTBOX_DATABASE_URL" -f deploy/initdb/orders_example.sql
CREATE TABLE IF NOT EXISTS example_orders (
    order_id    text PRIMARY KEY,
    state       text NOT NULL,
    amount      numeric,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS example_shipments (
    id          bigserial PRIMARY KEY,
    order_id    text NOT NULL,
    request_id  text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
