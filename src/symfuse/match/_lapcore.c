/* Kernels of the certified sparse assignment (see symfuse/match/assignment.py for the maths).
 *
 * Plain C99, no Python API: loaded with ctypes by symfuse/native.py, which holds a torch version of each kernel
 * (ctypes releases the GIL during the call, so matching threads run these in parallel). The cost matrix is
 * float32, row-major, n x n; every index is int64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float val;
    int32_t idx;
} Entry;

/* Replace the root of a max-heap of k entries (root = largest value) by (val, at), then sift it down. */
static void heap_replace_root(Entry *heap, int64_t k, float val, int32_t at) {
    int64_t pos = 0;
    for (;;) {
        int64_t child = 2 * pos + 1;
        if (child >= k) break;
        if (child + 1 < k && heap[child + 1].val > heap[child].val) child++;
        if (heap[child].val <= val) break;
        heap[pos] = heap[child];
        pos = child;
    }
    heap[pos].val = val;
    heap[pos].idx = at;
}

/* Push every flagged j (flag[j] != 0, j < n) into a heap; scans the flags 8 bytes at a time. */
static void push_flagged(const unsigned char *flag, int64_t n, const float *val, Entry *heap, int64_t k) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        uint64_t w;
        memcpy(&w, flag + j, 8);
        while (w) {
            int64_t t = j + (__builtin_ctzll(w) >> 3);
            w &= ~((uint64_t)0xff << ((t - j) << 3));
            if (val[t] < heap[0].val) heap_replace_root(heap, k, val[t], (int32_t)t);
        }
    }
    for (; j < n; j++)
        if (flag[j] && val[j] < heap[0].val) heap_replace_root(heap, k, val[j], (int32_t)j);
}

/* Candidates, in one pass over the rows after a column-minimum pass:
 *   row_idx[i, :] = columns of the k smallest r[i, j] = C[i, j] - min_i' C[i', j]      (column reduction)
 *   col_idx[j, :] = rows of the k smallest r[i, j] - min_j' r[i, j']                   (then row reduction)
 * The column heaps are updated from each reduced row while it is in cache: no transposed read of C. Each row is
 * first screened against fixed thresholds (vectorisable compares into a flag array); only flagged entries reach
 * a heap. The row threshold is the row minimum plus 1.5x the previous row's spread of its k smallest (a row
 * where fewer than k pass is scanned again without a screen). Also stores max |C| in *abs_max: infinity, with
 * row_idx / col_idx left unset, when C holds NaN or inf. Returns 0, or -1 when out of memory. */
int symfuse_candidates(const float *cost, int64_t n, int64_t k, int64_t *row_idx, int64_t *col_idx,
                       float *abs_max) {
    float *col_min = malloc(n * sizeof(float));
    float *red = malloc(n * sizeof(float));
    float *rel = malloc(n * sizeof(float));
    unsigned char *flag = malloc(n);
    Entry *row_heap = malloc(k * sizeof(Entry));
    Entry *col_heap = malloc(n * k * sizeof(Entry));
    float *col_top = malloc(n * sizeof(float));
    if (!col_min || !red || !rel || !flag || !row_heap || !col_heap || !col_top) {
        free(col_min), free(red), free(rel), free(flag), free(row_heap), free(col_heap), free(col_top);
        return -1;
    }
    float hi = -INFINITY, lo = INFINITY;
    int nonfinite = 0;
    for (int64_t j = 0; j < n; j++) col_min[j] = cost[j], rel[j] = cost[j]; /* rel: column maxima for now */
    for (int64_t i = 0; i < n; i++) {
        const float *row = cost + i * n;
        for (int64_t j = 0; j < n; j++) {
            col_min[j] = row[j] < col_min[j] ? row[j] : col_min[j];
            rel[j] = row[j] > rel[j] ? row[j] : rel[j];
            nonfinite |= !(row[j] - row[j] == 0.0f); /* inf - inf and NaN - NaN are NaN */
        }
    }
    for (int64_t j = 0; j < n; j++) {
        lo = col_min[j] < lo ? col_min[j] : lo;
        hi = rel[j] > hi ? rel[j] : hi;
    }
    *abs_max = hi > -lo ? hi : -lo;
    if (nonfinite) { /* no candidates: the caller hands a NaN / inf cost to the dense solver, which rejects it */
        *abs_max = INFINITY;
        free(col_min), free(red), free(rel), free(flag), free(row_heap), free(col_heap), free(col_top);
        return 0;
    }
    for (int64_t t = 0; t < n * k; t++) col_heap[t].val = INFINITY, col_heap[t].idx = -1;
    for (int64_t j = 0; j < n; j++) col_top[j] = INFINITY;
    float spread = INFINITY; /* previous row: its k-th smallest minus its minimum */
    for (int64_t i = 0; i < n; i++) {
        const float *row = cost + i * n;
        int64_t *out = row_idx + i * k;
        float row_min = INFINITY;
        for (int64_t j = 0; j < n; j++) {
            red[j] = row[j] - col_min[j];
            row_min = red[j] < row_min ? red[j] : row_min;
        }
        float thr = row_min + 1.5f * spread;
        for (int64_t t = 0; t < k; t++) row_heap[t].val = INFINITY, row_heap[t].idx = -1;
        for (int64_t j = 0; j < n; j++) flag[j] = red[j] <= thr;
        push_flagged(flag, n, red, row_heap, k);
        if (row_heap[0].val == INFINITY) { /* fewer than k passed the screen: the whole row, from an empty heap */
            for (int64_t t = 0; t < k; t++) row_heap[t].val = INFINITY, row_heap[t].idx = -1;
            for (int64_t j = 0; j < n; j++) flag[j] = 1;
            push_flagged(flag, n, red, row_heap, k);
        }
        for (int64_t t = 0; t < k; t++) out[t] = row_heap[t].idx;
        spread = row_heap[0].val - row_min;
        for (int64_t j = 0; j < n; j++) {
            rel[j] = red[j] - row_min;
            flag[j] = rel[j] < col_top[j];
        }
        int64_t j = 0;
        for (; j < n; j += 8) {
            uint64_t w = 0;
            if (j + 8 <= n) memcpy(&w, flag + j, 8);
            else
                for (int64_t t = j; t < n; t++) w |= (uint64_t)flag[t] << ((t - j) << 3);
            while (w) {
                int64_t c = j + (__builtin_ctzll(w) >> 3);
                w &= ~((uint64_t)0xff << ((c - j) << 3));
                heap_replace_root(col_heap + c * k, k, rel[c], (int32_t)i);
                col_top[c] = col_heap[c * k].val;
            }
        }
    }
    for (int64_t t = 0; t < n * k; t++) col_idx[t] = col_heap[t].idx;
    free(col_min), free(red), free(rel), free(flag), free(row_heap), free(col_heap), free(col_top);
    return 0;
}

/* Column potentials d with d[j] <= d[x[i]] + C[i, j] - C[i, x[i]] for every candidate (i, j) (label-correcting
 * shortest paths, FIFO queue, from the given start; edge weights in float64 from the float32 costs). Candidates
 * are in CSR by row: row i's are indptr[i] .. indptr[i + 1], to columns cols[e]; their edges leave node x[i].
 * A relaxation must gain more than tol (rounding cannot loop). Returns 0; 1 on a negative cycle (a path of n
 * edges improved); 2 when more than max_relax relaxations did not settle (d is then lowered but not a fixed
 * point); -1 on no memory. */
int symfuse_potentials(const float *cost, int64_t n, const int64_t *indptr, const int64_t *cols, const int64_t *x,
                       double *d, double tol, int64_t max_relax) {
    int64_t *row_of = malloc(n * sizeof(int64_t)); /* node -> the row whose edges leave it */
    int64_t *queue = malloc(n * sizeof(int64_t));
    int64_t *hops = calloc(n, sizeof(int64_t));
    char *queued = malloc(n);
    double *w = malloc((indptr[n] > 0 ? indptr[n] : 1) * sizeof(double)); /* edge weights, read once row by row */
    if (!row_of || !queue || !hops || !queued || !w) {
        free(row_of), free(queue), free(hops), free(queued), free(w);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        const float *row = cost + i * n;
        for (int64_t e = indptr[i]; e < indptr[i + 1]; e++) w[e] = (double)row[cols[e]] - (double)row[x[i]];
    }
    for (int64_t i = 0; i < n; i++) row_of[x[i]] = i, queue[i] = i, queued[i] = 1;
    int64_t head = 0, size = n, status = 0;
    while (size > 0) {
        int64_t a = queue[head];
        head = head + 1 == n ? 0 : head + 1;
        size--;
        queued[a] = 0;
        int64_t i = row_of[a];
        for (int64_t e = indptr[i]; e < indptr[i + 1]; e++) {
            int64_t j = cols[e];
            double nd = d[a] + w[e];
            if (nd < d[j] - tol) {
                d[j] = nd;
                if (--max_relax < 0) {
                    status = 2;
                    goto done;
                }
                hops[j] = hops[a] + 1;
                if (hops[j] >= n) {
                    status = 1;
                    goto done;
                }
                if (!queued[j]) {
                    queue[(head + size) % n] = j;
                    size++;
                    queued[j] = 1;
                }
            }
        }
    }
done:
    free(row_of), free(queue), free(hops), free(queued), free(w);
    return (int)status;
}

/* Entries with a negative reduced cost C[i, j] - u_i - v_j < -tol, u_i = C[i, x_i] - v[x_i] (float64), in the
 * rows rows[0 .. n_rows) (all rows when rows is NULL). Writes the first cap of them as flat indices i * n + j to
 * out; returns how many there are in all. */
int64_t symfuse_violations(const float *cost, int64_t n, const int64_t *x, const double *v, double tol,
                           const int64_t *rows, int64_t n_rows, int64_t *out, int64_t cap) {
    int64_t count = 0;
    if (!rows) n_rows = n;
    for (int64_t r = 0; r < n_rows; r++) {
        int64_t i = rows ? rows[r] : r;
        const float *row = cost + i * n;
        double bound = ((double)row[x[i]] - v[x[i]]) - tol; /* u_i - tol */
        for (int64_t j = 0; j < n; j++) {
            if ((double)row[j] - v[j] < bound) {
                if (count < cap) out[count] = i * n + j;
                count++;
            }
        }
    }
    return count;
}

/* out[i] += sum_r (s[r, i] - a[r, cols[i]])^2, i < m, for row-major float32 s (d x m, row stride ld_s) and a
 * (d rows, row stride ld_a): squared distances between the columns of s and the chosen columns of a (float32
 * differences, float64 sums), reading both row by row. */
void symfuse_sqdist_columns(const float *s, int64_t ld_s, const float *a, int64_t ld_a, int64_t d, int64_t m,
                            const int64_t *cols, double *out) {
    for (int64_t r = 0; r < d; r++) {
        const float *sr = s + r * ld_s, *ar = a + r * ld_a;
        for (int64_t i = 0; i < m; i++) {
            float diff = sr[i] - ar[cols[i]];
            out[i] += (double)(diff * diff);
        }
    }
}

/* For each row i of a row-major float32 (rows x cols) matrix, cols >= 2: the column of its smallest entry (first
 * on ties) and the second smallest value (the smallest over the other columns). Eight interleaved lanes keep a
 * (smallest, its column, second smallest) each, with branch-free updates the compiler vectorises; the lanes are
 * merged at the end of the row. */
void symfuse_row_two_smallest(const float *m, int64_t rows, int64_t cols, int64_t *best, float *second) {
    enum { L = 8 };
    for (int64_t i = 0; i < rows; i++) {
        const float *row = m + i * cols;
        float m1[L], m2[L];
        int32_t j1[L];
        for (int l = 0; l < L; l++) m1[l] = INFINITY, m2[l] = INFINITY, j1[l] = INT32_MAX;
        int64_t j = 0;
        for (; j + L <= cols; j += L) {
            for (int l = 0; l < L; l++) {
                float v = row[j + l];
                int lower = v < m1[l];
                float hi = lower ? m1[l] : v; /* the larger of v and the lane's smallest */
                m2[l] = hi < m2[l] ? hi : m2[l];
                j1[l] = lower ? (int32_t)(j + l) : j1[l];
                m1[l] = lower ? v : m1[l];
            }
        }
        float v1 = INFINITY, v2 = INFINITY;
        int64_t b = INT64_MAX;
        for (int l = 0; l < L; l++) { /* merge the lanes: smallest first (lowest column on ties), then the rest */
            if (m1[l] < v1 || (m1[l] == v1 && j1[l] < b)) {
                v2 = v1 < v2 ? v1 : v2;
                v1 = m1[l], b = j1[l];
            } else {
                v2 = m1[l] < v2 ? m1[l] : v2;
            }
            v2 = m2[l] < v2 ? m2[l] : v2;
        }
        for (; j < cols; j++) { /* the tail, in column order */
            float v = row[j];
            if (v < v1) v2 = v1, v1 = v, b = j;
            else if (v < v2) v2 = v;
        }
        best[i] = b, second[i] = v2;
    }
}
