-- A producer's enqueue into today's shape.
INSERT INTO skq (payload) VALUES ('{}');
