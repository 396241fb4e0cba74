// The device side of one secure-aggregation round, sans-IO (protocols/secagg/client.py):
//
//   WAITING_CONFIG    RoundStart               check config, fresh X25519 c_u, s_u -> AdvertiseKeys   ADVERTISED
//   ADVERTISED        KeyDirectory             check neighbours' signed keys, Shamir-split s_u^SK and
//                                              b_u among {u} + N(u), AES-GCM per neighbour
//                                              -> EncryptedShares                                      SHARES_SENT
//   SHARES_SENT       ForwardedShares          decrypt, y_u = x_u + PRG(b_u) + Σ ±PRG(s_uv) in Z_{2^r}
//                                              -> MaskedInput                                          INPUT_SENT
//                                              (rows that do not decrypt: ShareAccusation of their
//                                              senders first, going on without their shares)
//   INPUT_SENT        ConsistencyCheckRequest  sign U3 -> ConsistencySignature                         CONSISTENCY_SENT
//   INPUT_SENT / CONSISTENCY_SENT  UnmaskRequest  b_v shares of survivors, s_v shares of dropped
//                                              peers, never both -> UnmaskShares                       FINISHED
//   any               RoundAborted             erase secrets                                           ABORTED
//   any               timeOut() (the caller's clock: the round is over)  erase secrets                  ABORTED
//
// Every message must come from the aggregator, to this device, for this (job, round, group), and
// verify under the aggregator's key; otherwise SecAggException and nothing changes. Handlers
// compute first and commit last; a ProtocolViolation aborts the round and erases the secrets, and
// so does a ReleaseRefused: the device's ReleaseGuard (optional), asked last before the masked input
// (with U1) and the unmask shares (with U3) leave, refused (protocols/secagg/client.py release_guard).
package org.fedfleet.secagg;

import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeSet;
import org.bouncycastle.crypto.params.X25519PrivateKeyParameters;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;
import org.fedfleet.secagg.SecAggException.ProtocolViolation;
import org.fedfleet.secagg.SecAggException.ReleaseRefused;

public final class ClientSecAgg {
    public enum State { WAITING_CONFIG, ADVERTISED, SHARES_SENT, INPUT_SENT, CONSISTENCY_SENT, FINISHED, ABORTED }

    static final int SECRET_BYTES = 32, SHARE_BYTES = Shamir.shareBytes(SECRET_BYTES),
            CIPHERTEXT_BYTES = Crypto.NONCE_BYTES + 2 * SHARE_BYTES + Crypto.TAG_BYTES;
    private static final byte[] CONSISTENCY_DOMAIN = "fedfleet/secagg/consistency/v1\n".getBytes(StandardCharsets.US_ASCII);

    private final String deviceId, aggregatorId, jobId, groupId;
    private final long roundId;
    private final Envelope.Signer identity;
    private final byte[] identityPublicKey, aggregatorKey;
    private double[] input;
    private final boolean distributedDp;
    private final ReleaseGuard releaseGuard;     // null: every input leaves
    private State state = State.WAITING_CONFIG;
    private RoundConfig config;
    private RingVector encoded;
    private X25519PrivateKeyParameters cipherKey, maskKey;
    private byte[] selfMaskSeed;
    private Set<String> participants = Collections.emptySet(), neighbours = Collections.emptySet(), u2 = Collections.emptySet();
    private Map<String, byte[]> identityKeys = new HashMap<>(), maskPublic = new HashMap<>(), shareKeys = new HashMap<>();
    private Map<String, byte[][]> held = new HashMap<>();   // owner -> {share of s^SK, share of b}
    private byte[][] ownShares;
    private byte[] signedSurvivors;
    public String abortReason;
    public List<String> accused = new ArrayList<>();   // neighbours whose share rows did not decrypt

    public ClientSecAgg(String deviceId, Envelope.Signer identity, byte[] identityPublicKey, String aggregatorId,
                        byte[] aggregatorKey, String jobId, long roundId, String groupId, double[] input) {
        this(deviceId, identity, identityPublicKey, aggregatorId, aggregatorKey, jobId, roundId, groupId, input, false);
    }

    /** distributedDp: the input carries this device's share of distributed-DP (Skellam) noise, which
     *  is sized for the 64-bit ring: a round in another ring is refused at its start. */
    public ClientSecAgg(String deviceId, Envelope.Signer identity, byte[] identityPublicKey, String aggregatorId,
                        byte[] aggregatorKey, String jobId, long roundId, String groupId, double[] input, boolean distributedDp) {
        this(deviceId, identity, identityPublicKey, aggregatorId, aggregatorKey, jobId, roundId, groupId, input, distributedDp, null);
    }

    /** releaseGuard: asked before the masked input and the unmask shares leave (the file's head); null: none. */
    public ClientSecAgg(String deviceId, Envelope.Signer identity, byte[] identityPublicKey, String aggregatorId,
                        byte[] aggregatorKey, String jobId, long roundId, String groupId, double[] input, boolean distributedDp,
                        ReleaseGuard releaseGuard) {
        this.distributedDp = distributedDp;
        this.releaseGuard = releaseGuard;
        this.deviceId = deviceId; this.identity = identity; this.identityPublicKey = identityPublicKey.clone();
        this.aggregatorId = aggregatorId; this.aggregatorKey = aggregatorKey.clone();
        this.jobId = jobId; this.roundId = roundId; this.groupId = groupId; this.input = input.clone();
    }

    public State state() { return state; }

    public boolean done() { return state == State.FINISHED || state == State.ABORTED; }

    /** The caller's clock says the round is over (protocols/secagg/client.py's Timeout row: any
     *  phase's aborts a live round): its secrets are erased; a round over already stays as it is. */
    public void timeOut() {
        if (!done()) abort();
    }

    /** Whether any of the round's secrets is still held: the X25519 private keys, the self-mask
     *  seed, the pairwise keys, its own or its neighbours' shares, the input (encoded or not). */
    public boolean holdsSecrets() {
        return cipherKey != null || maskKey != null || selfMaskSeed != null || !shareKeys.isEmpty() || !held.isEmpty()
                || ownShares != null || encoded != null || input != null;
    }

    public List<SecAggMessage> handle(SecAggMessage m) throws SecAggException {
        authenticate(m);
        String type = m.type();
        if (type.equals("secagg.round_aborted")) {
            Object reason = m.header.get("reason");
            abortReason = reason instanceof String ? (String) reason : "";
            if (!done()) abort();
            return Collections.emptyList();
        }
        if (done()) throw new SecAggException(type + ": round already " + state);
        try {
            switch (state) {
                case WAITING_CONFIG: expect(m, "secagg.round_start"); return onRoundStart(m);
                case ADVERTISED: expect(m, "secagg.key_directory"); return onKeyDirectory(m);
                case SHARES_SENT: expect(m, "secagg.forwarded_shares"); return onForwardedShares(m);
                case INPUT_SENT:
                    expect(m, config.consistencyCheck ? "secagg.consistency_request" : "secagg.unmask_request");
                    return config.consistencyCheck ? onConsistencyRequest(m) : onUnmaskRequest(m);
                default: expect(m, "secagg.unmask_request"); return onUnmaskRequest(m);
            }
        } catch (ProtocolViolation | ReleaseRefused e) {
            abort();
            throw e;
        }
    }

    // ---------------- checks ----------------
    private void authenticate(SecAggMessage m) throws SecAggException {
        Map<String, Object> h = m.header;
        if (!jobId.equals(h.get("job_id")) || !BigInteger.valueOf(roundId).equals(h.get("round_id")) || !groupId.equals(h.get("group_id")))
            throw new SecAggException(m.type() + " is for another round than " + jobId + "/" + roundId + "/" + groupId);
        if (!deviceId.equals(h.get("recipient"))) throw new SecAggException(m.type() + " is addressed to " + h.get("recipient"));
        if (!aggregatorId.equals(h.get("sender"))) throw new SecAggException(m.type() + " from " + h.get("sender") + ", expected the aggregator");
        SecAggMessage.verify(h, m.arrays, aggregatorKey);
    }

    /** The exact header keys and arrays of a server message type (Python's from_wire checks). */
    private static void expect(SecAggMessage m, String type) throws SecAggException {
        if (!type.equals(m.type())) throw new SecAggException(m.type() + " not expected now (waiting for " + type + ")");
        String[] payload, arrays;
        switch (type) {
            case "secagg.round_start": payload = new String[] {"config"}; arrays = new String[0]; break;
            case "secagg.key_directory": payload = new String[] {"neighbour_keys"}; arrays = new String[] {"participants", "identity_keys"}; break;
            case "secagg.forwarded_shares": payload = new String[] {"senders"}; arrays = new String[] {"ciphertexts"}; break;
            case "secagg.consistency_request": payload = new String[0]; arrays = new String[] {"survivors"}; break;
            default: payload = new String[0];
                arrays = new String[] {"survivors", "dropped", "consistency_signers", "consistency_signatures"};
        }
        Set<String> keys = new HashSet<>(Arrays.asList("type", "signature", "job_id", "round_id", "group_id", "sender", "recipient"));
        keys.addAll(Arrays.asList(payload));
        if (!m.header.keySet().equals(keys)) throw new SecAggException(type + " header keys " + new TreeSet<>(m.header.keySet()) + " != " + new TreeSet<>(keys));
        if (!m.arrays.keySet().equals(new HashSet<>(Arrays.asList(arrays)))) throw new SecAggException(type + " arrays must be exactly " + Arrays.toString(arrays));
        for (Envelope.Tensor t : m.arrays.values())
            if (!t.dtype.equals("uint8")) throw new SecAggException(type + " array " + t.name + " must be uint8");
    }

    private static byte[] rank1(SecAggMessage m, String name) throws SecAggException {
        Envelope.Tensor t = m.arrays.get(name);
        if (t.shape.length != 1) throw new SecAggException(name + " must be a 1-D array");
        return t.data;
    }

    private static byte[][] rows(SecAggMessage m, String name, int width) throws SecAggException {
        Envelope.Tensor t = m.arrays.get(name);
        if (t.shape.length != 2 || t.shape[1] != width) throw new SecAggException(name + " must have rows of " + width + " bytes");
        byte[][] out = new byte[(int) t.shape[0]][];
        for (int r = 0; r < out.length; r++) out[r] = Arrays.copyOfRange(t.data, r * width, (r + 1) * width);
        return out;
    }

    @SuppressWarnings("unchecked")
    private static List<String> strings(Object value, String what) throws SecAggException {
        if (!(value instanceof List)) throw new SecAggException(what + " must be a list");
        List<String> out = new ArrayList<>();
        for (Object o : (List<Object>) value) {
            if (!(o instanceof String) || ((String) o).isEmpty()) throw new SecAggException(what + " items must be strings");
            out.add((String) o);
        }
        if (new HashSet<>(out).size() != out.size()) throw new SecAggException(what + " has duplicates");
        return out;
    }

    private void checkSurvivors(Set<String> survivors) throws ProtocolViolation {
        if (!survivors.contains(deviceId)) throw new ProtocolViolation("the survivor set leaves out this device, which did send its input");
        if (!participants.containsAll(survivors)) throw new ProtocolViolation("survivor set names devices that did not advertise keys");
        if (survivors.size() < config.threshold) throw new ProtocolViolation("only " + survivors.size() + " survivors, threshold is " + config.threshold);
        Set<String> stray = new HashSet<>(survivors);
        stray.retainAll(neighbours);
        stray.removeAll(u2);
        if (!stray.isEmpty()) throw new ProtocolViolation("survivors " + stray + " never sent their shares");
        // SecAgg+: dropouts the server chose could cut the graph; each part's sum would be unmasked
        if (!config.connects(new ArrayList<>(participants), survivors))
            throw new ProtocolViolation("the survivors' graph falls apart: the server would learn its parts' sums");
    }

    // ---------------- handlers: compute, then commit ----------------
    private List<SecAggMessage> onRoundStart(SecAggMessage m) throws SecAggException {
        RoundConfig c = RoundConfig.fromMap(m.header.get("config"));
        if (!c.jobId.equals(jobId) || c.roundId != roundId || !c.groupId.equals(groupId) || !c.aggregatorId.equals(aggregatorId))
            throw new SecAggException("round config does not describe this round");
        if (!c.isMember(deviceId)) throw new SecAggException(deviceId + " is not a member of group " + groupId);
        if (distributedDp && c.ringBits != RingVector.BITS_64)
            throw new SecAggException.InputRefused("distributed DP noise needs the 64-bit ring, the round declares ring_bits " + c.ringBits);
        RingVector enc;
        try {
            enc = c.encode(input);
        } catch (SecAggException e) {
            throw new SecAggException.InputRefused(e.getMessage());
        }
        X25519PrivateKeyParameters ck = Crypto.x25519(), mk = Crypto.x25519();
        Map<String, Object> payload = new LinkedHashMap<>();
        payload.put("cipher_public_key", SecAggMessage.b64(Crypto.publicBytes(ck)));
        payload.put("mask_public_key", SecAggMessage.b64(Crypto.publicBytes(mk)));
        SecAggMessage reply = reply("secagg.advertise_keys", payload, SecAggMessage.noArrays());
        config = c; encoded = enc; cipherKey = ck; maskKey = mk;
        state = State.ADVERTISED;
        return Collections.singletonList(reply);
    }

    @SuppressWarnings("unchecked")
    private List<SecAggMessage> onKeyDirectory(SecAggMessage m) throws SecAggException {
        List<String> u1 = config.fromBitmap(rank1(m, "participants"));
        if (!u1.contains(deviceId)) throw new ProtocolViolation("key directory leaves out this device, which advertised its keys");
        if (u1.size() < config.threshold) throw new ProtocolViolation(u1.size() + " participants < threshold " + config.threshold);
        Set<String> nbrs = config.neighbours(u1, deviceId);
        if (!(m.header.get("neighbour_keys") instanceof List)) throw new SecAggException("neighbour_keys must be a list");
        Map<String, byte[][]> entries = new HashMap<>();     // device -> identity, cipher, mask, advertise signature
        for (Object row : (List<Object>) m.header.get("neighbour_keys")) {
            if (!(row instanceof List) || ((List<Object>) row).size() != 5) throw new SecAggException("each neighbour_keys entry must be a list of 5 items");
            List<Object> r = (List<Object>) row;
            if (!(r.get(0) instanceof String)) throw new SecAggException("neighbour id must be a string");
            byte[][] keys = {SecAggMessage.unb64(r.get(1), "identity key", 32), SecAggMessage.unb64(r.get(2), "cipher key", 32),
                    SecAggMessage.unb64(r.get(3), "mask key", 32), SecAggMessage.unb64(r.get(4), "advertise signature", 64)};
            if (entries.put((String) r.get(0), keys) != null) throw new SecAggException("neighbour_keys has duplicates");
        }
        if (!entries.keySet().equals(nbrs)) throw new ProtocolViolation("key directory does not hold exactly this device's graph neighbours");
        Map<String, byte[]> ids = new HashMap<>();
        for (Map.Entry<String, byte[][]> e : entries.entrySet()) ids.put(e.getKey(), e.getValue()[0]);
        ids.put(deviceId, identityPublicKey);
        byte[][] all = rows(m, "identity_keys", 32);
        if (config.consistencyCheck) {   // all of U1's identity keys, to check the consistency signatures
            if (all.length != u1.size()) throw new SecAggException("key directory must carry one identity key per participant");
            Map<String, byte[]> everyone = new HashMap<>();
            for (int i = 0; i < all.length; i++) everyone.put(u1.get(i), all[i]);
            for (Map.Entry<String, byte[]> e : ids.entrySet())
                if (!Arrays.equals(everyone.get(e.getKey()), e.getValue()))
                    throw new ProtocolViolation("key directory lists two different identity keys for one device");
            ids = everyone;
        }
        byte[] ownCipher = Crypto.publicBytes(cipherKey);
        Map<String, byte[]> sk = new HashMap<>(), mp = new HashMap<>();
        for (Map.Entry<String, byte[][]> e : entries.entrySet()) {
            String peer = e.getKey();
            byte[][] k = e.getValue();
            if (Arrays.equals(k[1], ownCipher)) throw new ProtocolViolation(peer + " advertises this device's own key");
            Map<String, Object> advertised = SecAggMessage.commonHeader("secagg.advertise_keys", jobId, roundId, groupId, peer, aggregatorId);
            advertised.put("cipher_public_key", SecAggMessage.b64(k[1]));
            advertised.put("mask_public_key", SecAggMessage.b64(k[2]));
            advertised.put("signature", SecAggMessage.b64(k[3]));
            SecAggMessage.verify(advertised, SecAggMessage.noArrays(), k[0]);   // the server cannot substitute keys
            sk.put(peer, Crypto.agree(cipherKey, k[1], context("share-key", low(deviceId, peer), high(deviceId, peer))));
            mp.put(peer, k[2]);
        }
        List<String> holders = new ArrayList<>(nbrs);
        holders.add(deviceId);
        holders.sort(Json.CODE_POINT_ORDER);
        long[] xs = new long[holders.size()];
        for (int i = 0; i < xs.length; i++) xs[i] = config.holderX(holders.get(i));
        byte[] seed = new byte[SECRET_BYTES];
        Crypto.RANDOM.nextBytes(seed);
        byte[][][] shares = Shamir.split(new byte[][] {maskKey.getEncoded(), seed}, config.shareThreshold, xs);
        Map<String, byte[][]> shareOf = new HashMap<>();
        for (int i = 0; i < xs.length; i++) shareOf.put(holders.get(i), shares[i]);
        List<Object> recipients = new ArrayList<>();
        List<String> sorted = new ArrayList<>(nbrs);
        sorted.sort(Json.CODE_POINT_ORDER);
        byte[] cts = new byte[sorted.size() * CIPHERTEXT_BYTES];
        for (int r = 0; r < sorted.size(); r++) {
            String peer = sorted.get(r);
            byte[][] s = shareOf.get(peer);
            byte[] plain = Arrays.copyOf(s[0], 2 * SHARE_BYTES);
            System.arraycopy(s[1], 0, plain, SHARE_BYTES, SHARE_BYTES);
            byte[] blob = Crypto.aeadEncrypt(sk.get(peer), plain, context("share-aad", deviceId, peer));
            System.arraycopy(blob, 0, cts, r * CIPHERTEXT_BYTES, CIPHERTEXT_BYTES);
            recipients.add(peer);
        }
        Map<String, Object> payload = new LinkedHashMap<>();
        payload.put("recipients", recipients);
        payload.put("self_mask_commitment", SecAggMessage.b64(Crypto.sha256(context("self-mask-commitment", deviceId), seed)));
        SecAggMessage reply = reply("secagg.encrypted_shares", payload,
                SecAggMessage.arrays(new Envelope.Tensor("ciphertexts", "uint8", new long[] {sorted.size(), CIPHERTEXT_BYTES}, cts)));
        participants = new HashSet<>(u1); identityKeys = ids; neighbours = nbrs; maskPublic = mp; shareKeys = sk;
        selfMaskSeed = seed; ownShares = shareOf.get(deviceId);
        state = State.SHARES_SENT;
        return Collections.singletonList(reply);
    }

    private List<SecAggMessage> onForwardedShares(SecAggMessage m) throws SecAggException {
        List<String> senders = strings(m.header.get("senders"), "senders");
        byte[][] cts = rows(m, "ciphertexts", CIPHERTEXT_BYTES);
        if (cts.length != senders.size()) throw new SecAggException("ciphertexts: " + cts.length + " rows for " + senders.size() + " senders");
        if (!neighbours.containsAll(senders)) throw new ProtocolViolation("forwarded shares from devices that are not graph neighbours");
        // too few pair masks (none: y_u = x_u + PRG(b_u), b_u revealed by the other holders): as client.py
        if (senders.size() + 1 < config.shareThreshold)
            throw new ProtocolViolation("only " + senders.size() + " neighbours' shares forwarded: fewer than share threshold "
                    + config.shareThreshold + " holders, this device's input would be unmaskable alone");
        Map<String, byte[][]> got = new HashMap<>();
        List<String> bad = new ArrayList<>();
        for (int i = 0; i < senders.size(); i++) {
            String peer = senders.get(i);
            byte[] plain;
            try {
                plain = Crypto.aeadDecrypt(shareKeys.get(peer), cts[i], context("share-aad", peer, deviceId));
            } catch (SecAggException e) {      // its shares are lost to this device; the other holders cover them
                bad.add(peer);
                continue;
            }
            got.put(peer, new byte[][] {Arrays.copyOf(plain, SHARE_BYTES), Arrays.copyOfRange(plain, SHARE_BYTES, 2 * SHARE_BYTES)});
        }
        RingVector masked = encoded.copy();
        masked.addMask(selfMaskSeed, 1);
        for (String peer : senders) {
            byte[] pairSeed = Crypto.agree(maskKey, maskPublic.get(peer), context("pair-mask", low(deviceId, peer), high(deviceId, peer)));
            masked.addMask(pairSeed, Json.CODE_POINT_ORDER.compare(deviceId, peer) < 0 ? 1 : -1);
        }
        List<SecAggMessage> replies = new ArrayList<>();
        if (!bad.isEmpty()) {                   // first: the masked input may close the phase
            Map<String, Object> accusation = new LinkedHashMap<>();
            accusation.put("accused", new ArrayList<Object>(bad));
            replies.add(reply("secagg.share_accusation", accusation, SecAggMessage.noArrays()));
        }
        replies.add(reply("secagg.masked_input", new LinkedHashMap<String, Object>(),
                SecAggMessage.arrays(masked.tensor("masked_input"))));
        askGuard(releaseGuard == null ? null : releaseGuard.maskedInput(Collections.unmodifiableSet(participants)));  // last: it may record the release
        held = got; u2 = new HashSet<>(senders); accused = bad; encoded = null; input = null;
        state = State.INPUT_SENT;
        return replies;
    }

    private List<SecAggMessage> onConsistencyRequest(SecAggMessage m) throws SecAggException {
        byte[] bitmap = rank1(m, "survivors");
        checkSurvivors(new HashSet<>(config.fromBitmap(bitmap)));
        Map<String, Object> payload = new LinkedHashMap<>();
        payload.put("survivors_signature", SecAggMessage.b64(identity.sign(consistencyStatement(bitmap))));
        SecAggMessage reply = reply("secagg.consistency_signature", payload, SecAggMessage.noArrays());
        signedSurvivors = bitmap.clone();
        state = State.CONSISTENCY_SENT;
        return Collections.singletonList(reply);
    }

    private List<SecAggMessage> onUnmaskRequest(SecAggMessage m) throws SecAggException {
        byte[] bitmap = rank1(m, "survivors");
        Set<String> survivors = new HashSet<>(config.fromBitmap(bitmap)), dropped = new HashSet<>(config.fromBitmap(rank1(m, "dropped")));
        Set<String> both = new HashSet<>(survivors);
        both.retainAll(dropped);
        if (!both.isEmpty()) throw new ProtocolViolation("request asks for both shares of " + both);
        checkSurvivors(survivors);
        if (config.consistencyCheck) {
            if (!Arrays.equals(bitmap, signedSurvivors)) throw new ProtocolViolation("survivor set differs from the one this device signed");
            checkConsistencySignatures(m, bitmap, survivors);
        }
        List<String> owners = new ArrayList<>(held.keySet());     // an accused sender's: none held
        owners.add(deviceId);
        owners.sort(Json.CODE_POINT_ORDER);
        List<Object> selfOwners = new ArrayList<>(), keyOwners = new ArrayList<>();
        List<byte[]> selfShares = new ArrayList<>(), keyShares = new ArrayList<>();
        for (String owner : owners) {
            byte[][] s = owner.equals(deviceId) ? ownShares : held.get(owner);
            if (survivors.contains(owner)) { selfOwners.add(owner); selfShares.add(s[1]); }
            else if (dropped.contains(owner)) { keyOwners.add(owner); keyShares.add(s[0]); }
        }
        Map<String, Object> payload = new LinkedHashMap<>();
        payload.put("self_mask_owners", selfOwners);
        payload.put("key_owners", keyOwners);
        SecAggMessage reply = reply("secagg.unmask_shares", payload, SecAggMessage.arrays(
                shareRows("self_mask_shares", selfShares), shareRows("key_shares", keyShares)));
        askGuard(releaseGuard == null ? null : releaseGuard.unmask(Collections.unmodifiableSet(survivors)));
        eraseSecrets();
        state = State.FINISHED;
        return Collections.singletonList(reply);
    }

    private void checkConsistencySignatures(SecAggMessage m, byte[] bitmap, Set<String> survivors) throws SecAggException {
        List<String> signers = config.fromBitmap(rank1(m, "consistency_signers"));
        byte[][] sigs = rows(m, "consistency_signatures", 64);
        if (sigs.length != signers.size()) throw new SecAggException("one 64-byte consistency signature per signer expected");
        byte[] statement = consistencyStatement(bitmap);
        int valid = 0;
        for (int i = 0; i < signers.size() && valid < config.threshold; i++) {
            String signer = signers.get(i);
            byte[] key = identityKeys.get(signer);
            if (survivors.contains(signer) && key != null && SecAggMessage.verifyRaw(key, statement, sigs[i])) valid++;
        }
        if (valid < config.threshold) throw new ProtocolViolation("only " + valid + " valid consistency signatures, need " + config.threshold);
    }

    // ---------------- helpers ----------------
    private static void askGuard(String refusal) throws ReleaseRefused {
        if (refusal != null) throw new ReleaseRefused(refusal);
    }

    private SecAggMessage reply(String type, Map<String, Object> payload, Map<String, Envelope.Tensor> arrays) throws SecAggException {
        return SecAggMessage.signed(type, jobId, roundId, groupId, deviceId, aggregatorId, payload, arrays, identity);
    }

    /** "fedfleet/secagg/{purpose}/v1\n" + JSON([job, round, group, parties...]) (derivation.py's RoundContext.encode). */
    private byte[] context(String purpose, String... parties) throws SecAggException {
        List<Object> items = new ArrayList<>(Arrays.<Object>asList(jobId, BigInteger.valueOf(roundId), groupId));
        items.addAll(Arrays.asList(parties));
        return concat(("fedfleet/secagg/" + purpose + "/v1\n").getBytes(StandardCharsets.UTF_8), ascii(items));
    }

    private byte[] consistencyStatement(byte[] bitmap) throws SecAggException {
        return concat(CONSISTENCY_DOMAIN, ascii(Arrays.<Object>asList(jobId, BigInteger.valueOf(roundId), groupId)), new byte[] {'\n'}, bitmap);
    }

    private static byte[] ascii(Object v) throws SecAggException {
        try { return Json.canonicalAscii(v); } catch (Json.JsonError e) { throw new SecAggException(e.getMessage()); }
    }

    private static byte[] concat(byte[]... parts) {
        int n = 0;
        for (byte[] p : parts) n += p.length;
        byte[] out = new byte[n];
        int at = 0;
        for (byte[] p : parts) { System.arraycopy(p, 0, out, at, p.length); at += p.length; }
        return out;
    }

    private static Envelope.Tensor shareRows(String name, List<byte[]> shares) {
        byte[] data = new byte[shares.size() * SHARE_BYTES];
        for (int r = 0; r < shares.size(); r++) System.arraycopy(shares.get(r), 0, data, r * SHARE_BYTES, SHARE_BYTES);
        return new Envelope.Tensor(name, "uint8", new long[] {shares.size(), SHARE_BYTES}, data);
    }

    private static String low(String a, String b) { return Json.CODE_POINT_ORDER.compare(a, b) <= 0 ? a : b; }

    private static String high(String a, String b) { return Json.CODE_POINT_ORDER.compare(a, b) <= 0 ? b : a; }

    private void eraseSecrets() {
        cipherKey = maskKey = null;
        selfMaskSeed = null;
        shareKeys = new HashMap<>();
        held = new HashMap<>();
        ownShares = null;
        encoded = null;
        input = null;
    }

    private void abort() {
        eraseSecrets();
        state = State.ABORTED;
    }
}
