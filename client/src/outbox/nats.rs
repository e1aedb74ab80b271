//! [`NatsSink`]: publishes to NATS JetStream with the message id as `Nats-Msg-Id`, so that the
//! stream drops a repeat within its duplicate window (two minutes unless the stream says otherwise).

use async_nats::header::HeaderMap;
use async_nats::jetstream::{self, message::PublishMessage};
use futures_util::future::join_all;

use super::{Delivery, Message, Sink};

/// A [`Sink`] into NATS JetStream. The subjects must belong to a stream; a publish to a subject
/// of none fails (and is retried, then dead-lettered), as does one over the server's
/// `max_payload`.
#[derive(Clone)]
pub struct NatsSink {
    context: jetstream::Context,
}

impl NatsSink {
    /// A sink publishing through `context` (`async_nats::jetstream::new(client)`).
    pub fn new(context: jetstream::Context) -> Self {
        Self { context }
    }
}

#[async_trait::async_trait]
impl Sink for NatsSink {
    /// Sends every publish of the batch before awaiting any acknowledgement: one round trip for
    /// the batch, not one per message (a batch holds one message per key at most).
    async fn publish(&self, batch: &[Message]) -> Vec<Delivery> {
        let mut pending = Vec::with_capacity(batch.len());
        for message in batch {
            let mut headers = HeaderMap::new();
            for (name, values) in &message.headers {
                for value in values {
                    headers.append(name.as_str(), value.as_str());
                }
            }
            let publish = PublishMessage::build()
                .payload(message.payload.clone())
                .headers(headers)
                .message_id(message.message_id());
            pending.push(
                self.context
                    .send_publish(message.subject.clone(), publish)
                    .await,
            );
        }
        let acks = join_all(pending.into_iter().map(|sent| async move {
            match sent {
                Ok(ack) => match ack.await {
                    Ok(ack) => Delivery::Sent {
                        duplicate: ack.duplicate,
                    },
                    Err(error) => Delivery::Failed(error.to_string()),
                },
                Err(error) => Delivery::Failed(error.to_string()),
            }
        }));
        acks.await
    }
}
