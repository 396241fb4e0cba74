// What an MQTT callback hands a device's own thread, bounded in bytes as the Python device's
// message loop is (protocols/message_loop.py, QueueBound): a message that would take what one topic,
// or the whole queue, may hold unread past its bound is dropped on arrival and counted. The bound is
// bytes, not messages: a count let 1,024 messages of up to 256 MiB each wait for a busy device (a
// review's finding), where anyone who may publish to its inbox could fill its heap.
// A message is charged its payload plus MESSAGE_OVERHEAD_BYTES (its entry, the array, the topic), so
// a flood of empty messages is bounded too. offer never blocks (it runs on the connection's thread);
// a message's bytes are free again when the device's thread takes it.
package org.fedfleet.device;

import java.util.ArrayDeque;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import java.util.logging.Logger;
import org.fedfleet.wire.LogText;

public final class InboxQueue<T> {
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device");
    public static final long MESSAGE_OVERHEAD_BYTES = 256;       // as protocols/message_loop.py
    private static final long DROP_LOG_NANOS = TimeUnit.SECONDS.toNanos(10);   // a flood must not flood the log

    private static final class Entry<T> {
        final String topic; final T item; final long bytes;
        Entry(String topic, T item, long bytes) { this.topic = topic; this.item = item; this.bytes = bytes; }
    }

    public final String name;
    public final long topicBytes, totalBytes;
    private final ArrayDeque<Entry<T>> entries = new ArrayDeque<>();
    private final Map<String, Long> queued = new HashMap<>();     // topic -> bytes waiting from it
    private long queuedTotal, dropped, dropLogged;

    public InboxQueue(String name, long topicBytes, long totalBytes) {
        if (!(0 < topicBytes && topicBytes <= totalBytes))
            throw new IllegalArgumentException("an inbox bound needs 0 < topic bytes <= total bytes, got "
                    + topicBytes + " and " + totalBytes);
        this.name = name;
        this.topicBytes = topicBytes;
        this.totalBytes = totalBytes;
    }

    /** Queue {@code item} of {@code payloadBytes} from {@code topic}; false (dropped, counted) past the bound. */
    public synchronized boolean offer(String topic, T item, long payloadBytes) {
        long bytes = payloadBytes + MESSAGE_OVERHEAD_BYTES, held = queued.getOrDefault(topic, 0L);
        if (held + bytes > topicBytes || queuedTotal + bytes > totalBytes) {
            dropped++;
            long now = System.nanoTime();
            if (dropped == 1 || now - dropLogged >= DROP_LOG_NANOS) {
                dropLogged = now;
                LOG.warning(name + ": a message of " + bytes + " bytes on " + (topic.length() > 120 ? topic.substring(0, 120) : topic) + " dropped unread: " + held
                        + " bytes queued from it, " + queuedTotal + " in all (bounds " + topicBytes + ", " + totalBytes
                        + "); " + dropped + " dropped so far");
            }
            return false;
        }
        queued.put(topic, held + bytes);
        queuedTotal += bytes;
        entries.addLast(new Entry<>(topic, item, bytes));
        notifyAll();
        return true;
    }

    /** The oldest item, waiting at most {@code timeoutMs} for one; null if none came. */
    public synchronized T poll(long timeoutMs) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMs);
        while (entries.isEmpty()) {
            long left = deadline - System.nanoTime();
            if (left <= 0) return null;
            TimeUnit.NANOSECONDS.timedWait(this, left);
        }
        Entry<T> e = entries.removeFirst();
        long left = queued.getOrDefault(e.topic, 0L) - e.bytes;     // empty messages leave no entry
        if (left > 0) queued.put(e.topic, left); else queued.remove(e.topic);
        queuedTotal -= e.bytes;
        return e.item;
    }

    /** Messages dropped at the door so far. */
    public synchronized long dropped() { return dropped; }

    /** Bytes waiting now, in all. */
    public synchronized long queuedBytes() { return queuedTotal; }
}
