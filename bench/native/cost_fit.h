// Summaries for bench/native/device_call_costs: percentiles of repeated timings, and the fit of a
// call's cost to fixed_seconds + seconds_per_byte * bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace allocwatch {
namespace bench {

// The q-quantile (0..1) of samples, by linear interpolation between order statistics.
inline double quantile(std::vector<double> samples, double q) {
  if (samples.empty()) return 0.0;
  std::sort(samples.begin(), samples.end());
  double position = q * static_cast<double>(samples.size() - 1);
  std::size_t below = static_cast<std::size_t>(std::floor(position));
  std::size_t above = std::min(below + 1, samples.size() - 1);
  double fraction = position - static_cast<double>(below);
  return samples[below] + fraction * (samples[above] - samples[below]);
}

struct CostPoint {
  double bytes = 0;
  double seconds = 0;  // median of the repeats at this size
};

struct CostFit {
  double fixed_s = 0;
  double per_byte_s = 0;
  double worst_relative_error = 0;  // max over points of |predicted - measured| / measured
  double predict(double bytes) const { return fixed_s + per_byte_s * bytes; }
};

// Least squares on relative error (each point weighted by 1 / seconds^2). Plain least squares
// would let the 2 GiB points decide everything and leave the fixed part, which is what most
// calls in a trace pay, as noise (or negative). Both parts are kept non-negative.
inline CostFit fit_cost(const std::vector<CostPoint>& points) {
  CostFit fit;
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const CostPoint& p : points) {
    if (p.seconds <= 0) continue;
    double w = 1.0 / (p.seconds * p.seconds);
    sw += w;
    sx += w * p.bytes;
    sy += w * p.seconds;
    sxx += w * p.bytes * p.bytes;
    sxy += w * p.bytes * p.seconds;
  }
  if (sw == 0) return fit;
  double determinant = sw * sxx - sx * sx;
  if (determinant > 0) {
    fit.per_byte_s = (sw * sxy - sx * sy) / determinant;
    fit.fixed_s = (sy - fit.per_byte_s * sx) / sw;
  } else {  // a single size: no way to split the cost, call it all fixed
    fit.fixed_s = sy / sw;
  }
  if (fit.fixed_s < 0) {  // refit through the origin
    fit.fixed_s = 0;
    fit.per_byte_s = sxx > 0 ? sxy / sxx : 0;
  }
  if (fit.per_byte_s < 0) {  // no growth with size: a constant
    fit.per_byte_s = 0;
    fit.fixed_s = sy / sw;
  }
  for (const CostPoint& p : points) {
    if (p.seconds <= 0) continue;
    double error = std::fabs(fit.predict(p.bytes) - p.seconds) / p.seconds;
    fit.worst_relative_error = std::max(fit.worst_relative_error, error);
  }
  return fit;
}

}  // namespace bench
}  // namespace allocwatch
