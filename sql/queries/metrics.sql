-- Metrics: every database gauge of service/postbox/operations/metrics.py in one statement, rows of
-- (metric, label a, label b, value). Run on a timer by each process that serves metrics. The
-- function (sql/functions/roles_api_v1.sql) runs as the schema's owner: the worker, relay, bridge
-- and maintenance roles may read these counts without any right on the tables.

-- name: metrics_snapshot
SELECT metric, label_a, label_b, value
  FROM postbox.metrics_snapshot_v1(CAST(:now AS timestamptz), CAST(:stale_after AS float8));
