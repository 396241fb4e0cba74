// What a device's MQTT connections share (MqttAgent's and DeploymentFollower's): a persistent
// MQTT 3.1.1 session (clean session off, so what is published while it reconnects is delivered)
// that connects and reconnects on its own, forever, with backoff from 0.2 s to 5 s; the owner's
// own thread handles what the client's thread queues; close waits up to 5 s for a clean disconnect.
package org.fedfleet.device;

import java.net.URI;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.function.BiPredicate;
import java.util.logging.Level;
import java.util.logging.Logger;
import org.fedfleet.wire.LogText;
import org.fusesource.mqtt.client.Callback;
import org.fusesource.hawtbuf.Buffer;
import org.fusesource.hawtbuf.UTF8Buffer;
import org.fusesource.mqtt.client.CallbackConnection;
import org.fusesource.mqtt.client.Listener;
import org.fusesource.mqtt.client.MQTT;

final class DeviceConnection {
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device");

    private DeviceConnection() {}

    /** The settings every device connection uses; the caller adds its own (a last will) before connecting. */
    static MQTT settings(URI broker, String clientId, String username, String password) throws java.net.URISyntaxException {
        MQTT mqtt = new MQTT();
        mqtt.setHost(transportUri(broker));
        mqtt.setClientId(clientId);
        mqtt.setVersion("3.1.1");
        mqtt.setCleanSession(false);
        mqtt.setKeepAlive((short) 30);
        if (username != null) { mqtt.setUserName(username); mqtt.setPassword(password); }
        mqtt.setConnectAttemptsMax(-1);
        mqtt.setReconnectAttemptsMax(-1);
        mqtt.setReconnectDelay(200);
        mqtt.setReconnectDelayMax(5000);
        return mqtt;
    }

    /** On the client's thread: {@code onConnected} after every (re)connect, {@code onDisconnected} after a loss,
     *  and every message (topic, payload) handed to {@code queue} for the owner's thread, then acknowledged;
     *  {@code queue} answers false when the owner's inbox is full (the inbox counts the drop and logs it,
     *  at most once per 10 s: a flood must not flood the log).
     *  {@code label} starts the log lines ("dev1:", "dev1: deployment"). Each callback runs guarded
     *  (onClientThread). */
    @SuppressWarnings("deprecation")   // Listener: ExtendedListener's extra callbacks are not needed
    static void listen(CallbackConnection connection, String label, Runnable onConnected, Runnable onDisconnected,
                       BiPredicate<String, byte[]> queue) {
        connection.listener(new Listener() {
            @Override public void onConnected() { onClientThread(label, "announcing the connection", onConnected); }
            @Override public void onDisconnected() { onClientThread(label, "on a lost connection", onDisconnected); }
            @Override public void onPublish(UTF8Buffer topic, Buffer body, Runnable ack) {
                // a drop is counted and logged (rate-limited) by the inbox; acknowledged even when it throws,
                // or the broker delivered it again on every reconnect, failing the same way
                onClientThread(label, "queueing a message", () -> queue.test(topic.toString(), body.toByteArray()));
                ack.run();
            }
            @Override public void onFailure(Throwable e) { LOG.log(Level.WARNING, label + " connection failure", e); }
        });
    }

    /** Runs {@code step}, a callback of the MQTT client on its own thread, guarded: what it throws is
     *  logged and the connection goes on, except what ends a device's loop (MqttAgent.endsTheLoop),
     *  thrown on. Unguarded, anything it threw reached the client's transport (hawtdispatch's
     *  TcpTransport.drainInbound), which printed it and dropped the connection as failed: the client
     *  reconnected and called the same step again, so a step that always throws (an application's
     *  signer failing the presence) made the device reconnect for ever, every 0.2 to 5 s. */
    static void onClientThread(String label, String what, Runnable step) {
        try {
            step.run();
        } catch (Throwable e) {
            if (MqttAgent.endsTheLoop(e)) throw e;
            LOG.log(Level.SEVERE, label + " unexpected error " + what + " (on the MQTT client's thread); the connection goes on", e);
        }
    }

    /** Asks the client to connect (it retries on its own) and starts the owner's daemon thread running {@code loop}. */
    static Thread start(CallbackConnection connection, String deviceId, Runnable loop, String threadName) {
        connection.getDispatchQueue().execute(() -> connection.connect(new Callback<Void>() {
            @Override public void onSuccess(Void v) {}
            @Override public void onFailure(Throwable e) { LOG.log(Level.WARNING, deviceId + ": connect failed", e); }
        }));
        Thread thread = new Thread(loop, threadName);
        thread.setDaemon(true);
        thread.start();
        return thread;
    }

    /** Waits up to 10 s for the owner's thread (null: never started) to see it should stop. */
    static void join(Thread thread) {
        try {
            if (thread != null) thread.join(10_000);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    /** A clean disconnect (the last will is not fired), waiting for it up to 5 s. */
    static void disconnect(CallbackConnection connection) {
        CountDownLatch done = new CountDownLatch(1);
        connection.getDispatchQueue().execute(() -> connection.disconnect(new Callback<Void>() {
            @Override public void onSuccess(Void v) { done.countDown(); }
            @Override public void onFailure(Throwable e) { done.countDown(); }
        }));
        try {
            done.await(5, TimeUnit.SECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    /** fedfleet's broker addresses (mqtt://host:port, mqtts://) as the client's transports (tcp://, ssl://). */
    static URI transportUri(URI broker) throws java.net.URISyntaxException {
        String scheme = broker.getScheme();
        if ("mqtt".equals(scheme) || "tcp".equals(scheme))
            return new URI("tcp", null, broker.getHost(), broker.getPort() < 0 ? 1883 : broker.getPort(), null, null, null);
        if ("mqtts".equals(scheme) || "ssl".equals(scheme) || "tls".equals(scheme))
            return new URI("ssl", null, broker.getHost(), broker.getPort() < 0 ? 8883 : broker.getPort(), null, null, null);
        throw new IllegalArgumentException("broker URL " + broker + ": the scheme must be mqtt:// or mqtts://");
    }
}
