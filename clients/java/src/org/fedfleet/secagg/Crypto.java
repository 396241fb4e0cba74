// The primitives of docs/secure-aggregation.md "Cryptographic choices", bit-compatible with
// protocols/secagg/crypto.py: X25519 + HKDF-SHA256 (BouncyCastle, as Android lacks X25519 before
// API 33), AES-256-GCM share encryption (nonce || ct || tag) and the AES-128-CTR mask PRG.
package org.fedfleet.secagg;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.security.GeneralSecurityException;
import java.security.SecureRandom;
import java.util.Arrays;
import javax.crypto.Cipher;
import javax.crypto.spec.GCMParameterSpec;
import javax.crypto.spec.IvParameterSpec;
import javax.crypto.spec.SecretKeySpec;
import org.bouncycastle.crypto.agreement.X25519Agreement;
import org.bouncycastle.crypto.digests.SHA256Digest;
import org.bouncycastle.crypto.generators.HKDFBytesGenerator;
import org.bouncycastle.crypto.params.HKDFParameters;
import org.bouncycastle.crypto.params.X25519PrivateKeyParameters;
import org.bouncycastle.crypto.params.X25519PublicKeyParameters;
import org.fedfleet.wire.Envelope;

public final class Crypto {
    public static final SecureRandom RANDOM = new SecureRandom();
    static final int NONCE_BYTES = 12, TAG_BYTES = 16;
    private static final byte[] HKDF_SALT = "fedfleet/secagg/hkdf/v1".getBytes(StandardCharsets.US_ASCII);
    private static final byte[] PRG_DOMAIN = "fedfleet/secagg/prg/v1".getBytes(StandardCharsets.US_ASCII);
    private static final int BLOCK_BYTES = 1 << 18;   // 256 KiB of keystream at a time

    private Crypto() {}

    public static X25519PrivateKeyParameters x25519() { return new X25519PrivateKeyParameters(RANDOM); }

    public static byte[] publicBytes(X25519PrivateKeyParameters key) { return key.generatePublicKey().getEncoded(); }

    /** HKDF-SHA256(X25519(own, peer)) bound to info; a low-order peer key (all-zero secret) is refused. */
    public static byte[] agree(X25519PrivateKeyParameters own, byte[] peerPublic, byte[] info) throws SecAggException {
        if (peerPublic == null || peerPublic.length != 32) throw new SecAggException("an X25519 public key is 32 bytes");
        byte[] shared = new byte[32];
        try {
            X25519Agreement a = new X25519Agreement();
            a.init(own);
            a.calculateAgreement(new X25519PublicKeyParameters(peerPublic, 0), shared, 0);
        } catch (IllegalStateException e) {
            throw new SecAggException("unusable X25519 public key: " + e.getMessage());
        }
        HKDFBytesGenerator hkdf = new HKDFBytesGenerator(new SHA256Digest());
        hkdf.init(new HKDFParameters(shared, HKDF_SALT, info));
        byte[] out = new byte[32];
        hkdf.generateBytes(out, 0, 32);
        return out;
    }

    public static byte[] aeadEncrypt(byte[] key, byte[] plaintext, byte[] aad) {
        byte[] nonce = new byte[NONCE_BYTES];
        RANDOM.nextBytes(nonce);
        try {
            Cipher c = Cipher.getInstance("AES/GCM/NoPadding");
            c.init(Cipher.ENCRYPT_MODE, new SecretKeySpec(key, "AES"), new GCMParameterSpec(8 * TAG_BYTES, nonce));
            c.updateAAD(aad);
            byte[] ct = c.doFinal(plaintext);
            byte[] out = Arrays.copyOf(nonce, NONCE_BYTES + ct.length);
            System.arraycopy(ct, 0, out, NONCE_BYTES, ct.length);
            return out;
        } catch (GeneralSecurityException e) {
            throw new IllegalStateException("AES-GCM unavailable", e);
        }
    }

    public static byte[] aeadDecrypt(byte[] key, byte[] blob, byte[] aad) throws SecAggException {
        if (blob.length < NONCE_BYTES + TAG_BYTES) throw new SecAggException("ciphertext shorter than nonce + tag");
        try {
            Cipher c = Cipher.getInstance("AES/GCM/NoPadding");
            c.init(Cipher.DECRYPT_MODE, new SecretKeySpec(key, "AES"), new GCMParameterSpec(8 * TAG_BYTES, blob, 0, NONCE_BYTES));
            c.updateAAD(aad);
            return c.doFinal(blob, NONCE_BYTES, blob.length - NONCE_BYTES);
        } catch (javax.crypto.AEADBadTagException e) {
            throw new SecAggException("share ciphertext failed authentication (corrupted, or wrong key/context)");
        } catch (GeneralSecurityException e) {
            throw new SecAggException("share ciphertext cannot be decrypted: " + e);
        }
    }

    /** target += sign · PRG(seed) mod 2^64: the keystream read as little-endian uint64 words. */
    public static void addMask(long[] target, byte[] seed, int sign) {
        keystream(seed, target.length, Long.BYTES, (stream, start, n) -> {
            if (sign > 0) for (int k = 0; k < n; k++) target[start + k] += stream.getLong(Long.BYTES * k);   // longs wrap mod 2^64
            else for (int k = 0; k < n; k++) target[start + k] -= stream.getLong(Long.BYTES * k);
        });
    }

    /** target += sign · PRG(seed) mod 2^32: the same keystream read as little-endian uint32 words
     *  (word i = bytes 4i..4i+3), for a round in the 32-bit ring. */
    public static void addMask(int[] target, byte[] seed, int sign) {
        keystream(seed, target.length, Integer.BYTES, (stream, start, n) -> {
            if (sign > 0) for (int k = 0; k < n; k++) target[start + k] += stream.getInt(Integer.BYTES * k);   // ints wrap mod 2^32
            else for (int k = 0; k < n; k++) target[start + k] -= stream.getInt(Integer.BYTES * k);
        });
    }

    /** Consumes one block of the keystream: n words of the little-endian buffer, for target[start, start + n). */
    private interface Block { void add(ByteBuffer stream, int start, int n); }

    /** The mask PRG: AES-128-CTR keystream from a zero counter block, key
     *  SHA-256("fedfleet/secagg/prg/v1" || seed)[:16], handed out in blocks of whole words. */
    private static void keystream(byte[] seed, int words, int wordBytes, Block sink) {
        byte[] key = Arrays.copyOf(sha256(PRG_DOMAIN, seed), 16);
        try {
            Cipher aes = Cipher.getInstance("AES/CTR/NoPadding");
            aes.init(Cipher.ENCRYPT_MODE, new SecretKeySpec(key, "AES"), new IvParameterSpec(new byte[16]));
            int block = Math.min(BLOCK_BYTES / wordBytes, Math.max(words, 1));
            byte[] zeros = new byte[wordBytes * block], stream = new byte[wordBytes * block];
            ByteBuffer view = ByteBuffer.wrap(stream).order(ByteOrder.LITTLE_ENDIAN);   // buffers reused: no garbage per block
            for (int start = 0; start < words; start += block) {
                int n = Math.min(block, words - start);
                aes.update(zeros, 0, wordBytes * n, stream, 0);
                sink.add(view, start, n);
            }
        } catch (GeneralSecurityException e) {
            throw new IllegalStateException("AES-CTR unavailable", e);
        }
    }

    static byte[] sha256(byte[]... parts) {
        byte[] all = new byte[0];
        for (byte[] p : parts) {
            byte[] n = Arrays.copyOf(all, all.length + p.length);
            System.arraycopy(p, 0, n, all.length, p.length);
            all = n;
        }
        return Envelope.sha256(all);
    }
}
