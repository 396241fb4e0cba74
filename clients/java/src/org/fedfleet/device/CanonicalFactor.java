// The exact factor form of a device's Fed3R statistics (protocols/payloads/fed3r.py, edge_client/
// fed3r.py canonical_factor, docs/algorithms.md): for a device with fewer samples than features,
// over the columns K of its rows Z that are not zero in every row, the canonical factor R of
// A[K, K] = Z[:, K]ᵀ Z[:, K] (row echelon form, positive pivots, rank rows) and QᵀY (Z[:, K] = QR),
// by Householder QR that skips each column lying in the span of the pivot columns before it (its
// residual at most DEPENDENT_RESIDUAL of its norm): the same steps as the Python device's.
package org.fedfleet.device;

import java.util.ArrayList;
import java.util.List;

public final class CanonicalFactor {
    /** A column whose part orthogonal to the pivot columns before it is at most this fraction of
     *  its norm lies in their span (the Python device's threshold). */
    public static final double DEPENDENT_RESIDUAL = 1e-10;

    public final double[][] r, qty;     // r × q, r × m
    public final long[] zeroColumns;    // the columns of Z that are zero in every row
    public final int columns;           // q: R's columns, the others

    private CanonicalFactor(double[][] r, double[][] qty, long[] zeroColumns, int columns) {
        this.r = r; this.qty = qty; this.zeroColumns = zeroColumns; this.columns = columns;
    }

    /** The factor of rows Z (n × p) with one-hot labels Y (n × m). */
    public static CanonicalFactor of(double[][] z, double[][] y) {
        int n = z.length, p = z[0].length;
        List<Integer> live = new ArrayList<>();
        List<Long> zero = new ArrayList<>();
        for (int j = 0; j < p; j++) {
            boolean any = false;
            for (double[] row : z) any |= row[j] != 0;
            if (any) live.add(j); else zero.add((long) j);
        }
        int q = live.size();
        double[][] w = new double[n][q], v = new double[n][];
        for (int i = 0; i < n; i++) {
            for (int k = 0; k < q; k++) w[i][k] = z[i][live.get(k)];
            v[i] = y[i].clone();
        }
        double[] floor = new double[q];
        for (int k = 0; k < q; k++) floor[k] = DEPENDENT_RESIDUAL * norm(w, 0, k);
        List<Integer> pivots = new ArrayList<>();
        int col = 0;
        while (pivots.size() < n && col < q) {
            int row = pivots.size(), j = col;
            while (j < q && !(norm(w, row, j) > floor[j])) j++;
            if (j == q) break;
            for (int i = row; i < n; i++) for (int k = col; k < j; k++) w[i][k] = 0.0;   // dependent: rounding only
            double[] h = new double[n - row];                    // v = x + sign(x0)·‖x‖·e1
            for (int i = row; i < n; i++) h[i - row] = w[i][j];
            h[0] += Math.copySign(norm(w, row, j), h[0]);
            double hh = 0;
            for (double x : h) hh += x * x;
            reflect(h, 2.0 / hh, w, row, j);
            reflect(h, 2.0 / hh, v, row, 0);
            for (int i = row + 1; i < n; i++) w[i][j] = 0.0;
            if (w[row][j] < 0) {                                 // positive pivots
                for (int k = j; k < q; k++) w[row][k] = -w[row][k];
                for (int k = 0; k < v[row].length; k++) v[row][k] = -v[row][k];
            }
            pivots.add(j);
            col = j + 1;
        }
        int rank = pivots.size();
        double[][] r = new double[rank][], qty = new double[rank][];
        for (int i = 0; i < rank; i++) {
            r[i] = w[i];
            for (int k = 0; k < pivots.get(i); k++) r[i][k] = 0.0;    // exact zeros before each pivot
            qty[i] = v[i];
        }
        long[] zeros = new long[zero.size()];
        for (int k = 0; k < zeros.length; k++) zeros[k] = zero.get(k);
        return new CanonicalFactor(r, qty, zeros, q);
    }

    /** Whether R rounded to the wire dtype still is canonical: no zero row or column, row echelon
     *  form with strictly increasing positive pivots (protocols/payloads/fed3r.py check_canonical_factor). */
    public boolean canonicalAs(String dtype) {
        int q = columns, last = -1;
        boolean[] columnUsed = new boolean[q];
        for (double[] row : r) {
            int pivot = -1;
            for (int k = 0; k < q; k++) {
                double x = "float32".equals(dtype) ? (float) row[k] : row[k];
                if (x != 0) { columnUsed[k] = true; if (pivot < 0) pivot = k; }
            }
            double lead = pivot < 0 ? 0 : ("float32".equals(dtype) ? (float) row[pivot] : row[pivot]);
            if (pivot <= last || lead <= 0) return false;
            last = pivot;
        }
        for (boolean used : columnUsed) if (!used) return false;
        return true;
    }

    /** ‖W[row:, j]‖. */
    private static double norm(double[][] w, int row, int j) {
        double s = 0;
        for (int i = row; i < w.length; i++) s += w[i][j] * w[i][j];
        return Math.sqrt(s);
    }

    /** M[row:, from:] -= h ⊗ (scale · hᵀ M[row:, from:]) (a Householder reflection). */
    private static void reflect(double[] h, double scale, double[][] m, int row, int from) {
        int cols = m[row].length;
        double[] proj = new double[cols];
        for (int i = row; i < m.length; i++) for (int k = from; k < cols; k++) proj[k] += h[i - row] * m[i][k];
        for (int k = from; k < cols; k++) proj[k] *= scale;
        for (int i = row; i < m.length; i++) for (int k = from; k < cols; k++) m[i][k] -= h[i - row] * proj[k];
    }
}
