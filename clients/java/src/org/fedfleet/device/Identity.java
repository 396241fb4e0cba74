// A device's Ed25519 identity (docs/protocol.md "sig", docs/operations.md enrolment): the raw
// 32-byte public key is what the aggregator enrols; every envelope the device sends is signed.
// BouncyCastle's RFC 8032 implementation, since Android's provider has Ed25519 only from API 33.
package org.fedfleet.device;

import java.security.SecureRandom;
import org.bouncycastle.crypto.params.Ed25519PrivateKeyParameters;
import org.bouncycastle.crypto.signers.Ed25519Signer;
import org.fedfleet.wire.Envelope;

public final class Identity implements Envelope.Signer {
    public final String deviceId;
    private final Ed25519PrivateKeyParameters key;

    private Identity(String deviceId, Ed25519PrivateKeyParameters key) {
        this.deviceId = Topics.checkDeviceId(deviceId);
        this.key = key;
    }

    /** From the 32-byte private seed (keep it in the Android Keystore-wrapped storage of the app). */
    public static Identity fromSeed(String deviceId, byte[] seed) {
        if (seed.length != 32) throw new IllegalArgumentException("an Ed25519 seed is 32 bytes, got " + seed.length);
        return new Identity(deviceId, new Ed25519PrivateKeyParameters(seed, 0));
    }

    public static Identity generate(String deviceId) {
        return new Identity(deviceId, new Ed25519PrivateKeyParameters(new SecureRandom()));
    }

    public byte[] seed() { return key.getEncoded(); }

    public byte[] publicKey() { return key.generatePublicKey().getEncoded(); }

    @Override
    public byte[] sign(byte[] data) {
        Ed25519Signer s = new Ed25519Signer();
        s.init(true, key);
        s.update(data, 0, data.length);
        return s.generateSignature();
    }
}
